//! Per-block cost of `hash_blocks` against the digest alone over the same bytes.
//! `cargo run --release -p kvblocks-core --example floor_speed`

use kvblocks_core::{BlockHasher, HashAlgo, RequestKeys, HASH_ALGORITHMS};
use std::time::Instant;

fn best(mut f: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..200 {
        let start = Instant::now();
        f();
        best = best.min(start.elapsed().as_secs_f64());
    }
    best * 1e9 / 2048.0
}

fn main() -> Result<(), kvblocks_core::CoreError> {
    let tokens: Vec<u32> = (0..32768u32).map(|i| i.wrapping_mul(2_654_435_761) % 151_936).collect();
    for name in HASH_ALGORITHMS {
        let hasher = BlockHasher::new(HashAlgo::from_name(name)?, 16, "s".into())?;
        let keys = RequestKeys::default();
        let (data, ends) = hasher.serialized_blocks(&tokens, &keys);
        let whole = best(|| {
            std::hint::black_box(hasher.hash_blocks(&tokens, &keys));
        });
        let digest = best(|| {
            std::hint::black_box(hasher.digest_each(&data, &ends));
        });
        println!("{name:12} hash_blocks {whole:6.1} ns/block, digest alone {digest:6.1} ns/block");
    }
    Ok(())
}
