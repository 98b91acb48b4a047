//! Prints the time per block of `hash_blocks` for each algorithm on a 32k-token prompt.
//! `cargo run --release -p kvblocks-core --example hash_speed`

use kvblocks_core::{BlockHasher, HashAlgo, RequestKeys, HASH_ALGORITHMS};
use std::time::Instant;

fn main() -> Result<(), kvblocks_core::CoreError> {
    let tokens: Vec<u32> = (0..32768u32).map(|i| i.wrapping_mul(2_654_435_761) % 150_000).collect();
    for name in HASH_ALGORITHMS {
        let hasher = BlockHasher::new(HashAlgo::from_name(name)?, 16, "s".into())?;
        let mut best = f64::MAX;
        for _ in 0..20 {
            let start = Instant::now();
            let hashes = hasher.hash_blocks(&tokens, &RequestKeys::default());
            best = best.min(start.elapsed().as_secs_f64());
            std::hint::black_box(hashes);
        }
        println!("{name:12} {:8.1} ns/block", best * 1e9 / 2048.0);
    }
    Ok(())
}
