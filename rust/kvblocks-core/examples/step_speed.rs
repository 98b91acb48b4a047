//! Times `schedule_step` decode steps for 256 running requests.
//! `cargo run --release -p kvblocks-core --example step_speed`

use kvblocks_core::{
    BlockHasher, BlockManager, HashAlgo, ManagerConfig, RequestKeys, StepInput, StepOutput,
};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<(), kvblocks_core::CoreError> {
    let (n, b, len) = (256usize, 16usize, 1250usize);
    let hasher = Arc::new(BlockHasher::new(HashAlgo::Sha256Cbor, b, "s".into())?);
    let config = ManagerConfig {
        num_blocks: n * (len + 2000) / b,
        enable_caching: true,
        max_model_len: None,
        watermark: 0.0,
        log_stats: true,
        enable_events: false,
        verify_tokens: false,
        debug_key_bytes: None,
    };
    let mut m = BlockManager::new(config, hasher)?;
    let mut handles = Vec::new();
    for i in 0..n {
        let prompt: Vec<u32> = (0..len as u32).map(|t| t * 31 + i as u32 * 7919).collect();
        let h = m.add_request(&format!("r{i}"), &prompt, RequestKeys::default())?;
        m.allocate_slots(h, len, 0, &[], 0)?;
        handles.push(h);
    }
    let ones = vec![1i64; n];
    let offsets: Vec<i64> = (0..=n as i64).collect();
    let tokens = vec![7u32; n];
    let width = (len + 2000) / b;
    let (mut table, mut slots) = (vec![0i32; n * width], vec![0i32; n]);
    let (mut lens, mut starts) = (vec![0i32; n], vec![0i32; n + 1]);
    let mut best = f64::MAX;
    for _ in 0..1000 {
        let input = StepInput {
            handles: &handles,
            num_new_tokens: &ones,
            num_new_computed_tokens: None,
            prefix_lookup: None,
            num_lookahead_tokens: 0,
            new_token_ids: &tokens,
            new_token_offsets: Some(&offsets),
        };
        let mut out = StepOutput {
            block_table: &mut table,
            width,
            slot_mapping: &mut slots,
            seq_lens: &mut lens,
            query_start_loc: &mut starts,
        };
        let start = Instant::now();
        let result = m.schedule_step(&input, &mut out)?;
        best = best.min(start.elapsed().as_secs_f64());
        assert_eq!(result.num_scheduled, n);
    }
    println!("schedule_step, {n} decoding requests: best {:.1} us", best * 1e6);
    Ok(())
}
