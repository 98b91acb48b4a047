//! Times `schedule_step` decode steps for 256 running requests: each step appends the token
//! sampled for every row of the previous step and schedules one token per request.
//! `cargo run --release -p kvblocks-core --example step_speed`

use kvblocks_core::{
    BlockHasher, BlockManager, HashAlgo, ManagerConfig, RequestKeys, StepBuffers, StepInput,
};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<(), kvblocks_core::CoreError> {
    let (n, b, len) = (256usize, 16usize, 1250usize);
    let hasher = Arc::new(BlockHasher::new(HashAlgo::Sha256Cbor, b, "s".into())?);
    let config = ManagerConfig { num_blocks: n * (len + 2000) / b, ..ManagerConfig::default() };
    let mut m = BlockManager::new(config, hasher)?;
    let mut handles = Vec::new();
    for i in 0..n {
        let prompt: Vec<u32> = (0..len as u32).map(|t| t * 31 + i as u32 * 7919).collect();
        handles.push(m.add_request(&format!("r{i}"), &prompt, RequestKeys::default())?);
    }
    let mut buffers = StepBuffers::new(n, n * len, (len + 2000) / b);
    let sampled = vec![Some(7u32); n];
    let mut best = f64::MAX;
    for step in 0..1000 {
        let input = StepInput {
            handles: &handles,
            sampled_token_ids: (step > 0).then_some(sampled.as_slice()),
            token_budget: Some(n * len),
            ..StepInput::default()
        };
        let start = Instant::now();
        let result = m.schedule_step(input, &mut buffers.output())?;
        if step > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
        assert_eq!(result.num_scheduled, n);
    }
    println!("schedule_step, {n} decoding requests: best {:.1} us", best * 1e6);
    Ok(())
}
