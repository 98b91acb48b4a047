//! Benchmark-only: what `benches/bench_hashing.py` needs to measure the floor under block
//! hashing, i.e. the digest alone over each block's exact bytes, serialized beforehand.
//! Nothing else in kvblocks uses these; they exist so that the benchmark can divide
//! kvblocks' hashing time by what the digest by itself costs on the same bytes.

use super::{BlockHash, BlockHasher, HashChain, RequestKeys};

/// The bytes `hasher.hash_blocks(tokens, keys)` digests for each full block, concatenated,
/// and where each block's bytes end.
pub fn serialized_blocks(
    hasher: &BlockHasher,
    tokens: &[u32],
    keys: &RequestKeys,
) -> (Vec<u8>, Vec<u64>) {
    let mut chain = HashChain::default();
    let (mut data, mut ends) = (Vec::new(), Vec::new());
    let mut parent: Option<BlockHash> = None;
    for block in tokens.chunks_exact(hasher.block_size()) {
        let hash = chain.next(hasher, parent.as_ref().map(BlockHash::as_bytes), block, keys);
        data.extend_from_slice(&chain.scratch);
        ends.push(data.len() as u64);
        parent = Some(hash);
    }
    (data, ends)
}

/// Digests each of the consecutive ranges of `data` that end at `ends` with `hasher`'s digest
/// and nothing else. Returns how many ranges were digested.
pub fn digest_each(hasher: &BlockHasher, data: &[u8], ends: &[u64]) -> usize {
    let mut start = 0;
    let mut count = 0;
    for &end in ends {
        let end = usize::try_from(end).unwrap_or(usize::MAX);
        if let Some(bytes) = data.get(start..end) {
            std::hint::black_box(hasher.algo().digest(bytes));
            count += 1;
        }
        start = end;
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{HashAlgo, DEFAULT_SEED};

    #[test]
    fn the_serialized_bytes_digest_to_the_block_hashes() {
        let tokens: Vec<u32> = (0..50).map(|i| i * 7919).collect();
        for name in crate::HASH_ALGORITHMS {
            let algo = HashAlgo::from_name(name).unwrap();
            let hasher = BlockHasher::new(algo, 8, DEFAULT_SEED.to_owned()).unwrap();
            let (data, ends) = serialized_blocks(&hasher, &tokens, &RequestKeys::default());
            let expected = hasher.hash_blocks(&tokens, &RequestKeys::default());
            assert_eq!(ends.len(), expected.len());
            let mut start = 0;
            for (&end, hash) in ends.iter().zip(&expected) {
                assert_eq!(algo.digest(&data[start..end as usize]), *hash, "{name}");
                start = end as usize;
            }
            assert_eq!(digest_each(&hasher, &data, &ends), expected.len());
        }
    }
}
