//! A request's tokens, owned in Rust: an immutable prompt and append-only output tokens,
//! with the chained hash of every full block kept up to date as tokens arrive.

use crate::hashing::{BlockHash, BlockHasher, HashChain, RequestKeys};
use crate::{CoreError, CoreResult};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct TokenSequence {
    hasher: Arc<BlockHasher>,
    keys: RequestKeys,
    /// Never reallocated after construction, so views of it stay valid.
    prompt: Arc<[u32]>,
    output: Vec<u32>,
    block_hashes: Vec<BlockHash>,
    chain: HashChain,
    /// Holds a block that straddles the prompt/output boundary while it is hashed.
    straddle: Vec<u32>,
}

impl TokenSequence {
    /// Takes the prompt and hashes its full blocks. An empty prompt is refused, as vLLM does.
    pub fn new(hasher: Arc<BlockHasher>, prompt: &[u32], keys: RequestKeys) -> CoreResult<Self> {
        if prompt.is_empty() {
            return Err(CoreError::InvalidSize { what: "prompt length (must be >= 1)", value: 0 });
        }
        let mut seq = Self {
            hasher,
            keys,
            prompt: Arc::from(prompt),
            output: Vec::new(),
            block_hashes: Vec::new(),
            chain: HashChain::default(),
            straddle: Vec::new(),
        };
        seq.hash_new_blocks();
        Ok(seq)
    }

    /// Appends accepted output tokens and hashes the blocks that just became full (never
    /// rehashing earlier ones).
    pub fn append_token_ids(&mut self, token_ids: &[u32]) {
        self.output.extend_from_slice(token_ids);
        self.hash_new_blocks();
    }

    fn hash_new_blocks(&mut self) {
        let block_size = self.hasher.block_size();
        let num_prompt = self.prompt.len();
        let num_full = self.num_tokens() / block_size;
        self.block_hashes.reserve(num_full.saturating_sub(self.block_hashes.len()));
        for index in self.block_hashes.len()..num_full {
            let (start, end) = (index * block_size, (index + 1) * block_size);
            let block: &[u32] = if end <= num_prompt {
                self.prompt.get(start..end).unwrap_or_default()
            } else if start >= num_prompt {
                self.output.get(start - num_prompt..end - num_prompt).unwrap_or_default()
            } else {
                self.straddle.clear();
                self.straddle.extend_from_slice(self.prompt.get(start..).unwrap_or_default());
                let rest = end - num_prompt;
                self.straddle.extend_from_slice(self.output.get(..rest).unwrap_or_default());
                &self.straddle
            };
            let parent = self.block_hashes.last().map(BlockHash::as_bytes);
            let hash = self.chain.next(&self.hasher, parent, block, &self.keys);
            self.block_hashes.push(hash);
        }
    }

    pub fn hasher(&self) -> &Arc<BlockHasher> {
        &self.hasher
    }

    pub fn keys(&self) -> &RequestKeys {
        &self.keys
    }

    pub fn num_tokens(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    pub fn num_prompt_tokens(&self) -> usize {
        self.prompt.len()
    }

    pub fn num_output_tokens(&self) -> usize {
        self.output.len()
    }

    /// The last token (the prompt is never empty).
    pub fn last_token_id(&self) -> u32 {
        self.output.last().or(self.prompt.last()).copied().unwrap_or_default()
    }

    pub fn prompt(&self) -> &Arc<[u32]> {
        &self.prompt
    }

    pub fn output(&self) -> &[u32] {
        &self.output
    }

    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.block_hashes
    }

    /// The tokens at positions `[start, end)` (clamped to the tokens that exist).
    pub fn tokens_in(&self, start: usize, end: usize) -> impl Iterator<Item = u32> + '_ {
        let p = self.prompt.len();
        let from_prompt = self.prompt.get(start.min(p)..end.min(p)).unwrap_or_default();
        let (os, oe) = (start.saturating_sub(p), end.saturating_sub(p).min(self.output.len()));
        let from_output = self.output.get(os.min(oe)..oe).unwrap_or_default();
        from_prompt.iter().chain(from_output).copied()
    }

    /// All tokens, prompt then output.
    pub fn token_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompt.iter().chain(self.output.iter()).copied()
    }

    /// The first `n` tokens split as vLLM's `get_prefix_token_ids`: the prompt part, and the
    /// output part only when `n` reaches past the prompt.
    pub fn prefix_token_ids(&self, n: usize) -> CoreResult<(&[u32], Option<&[u32]>)> {
        let total = self.num_tokens();
        if n > total {
            return Err(CoreError::OutOfRange { what: "prefix length", value: n, limit: total });
        }
        let num_prompt = self.prompt.len();
        if n <= num_prompt {
            Ok((self.prompt.get(..n).unwrap_or_default(), None))
        } else {
            Ok((&self.prompt, Some(self.output.get(..n - num_prompt).unwrap_or_default())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{resolve_seed, HashAlgo, MmFeature};

    fn hasher(block_size: usize) -> Arc<BlockHasher> {
        let algo = HashAlgo::Sha256Cbor;
        Arc::new(
            BlockHasher::new(algo, block_size, resolve_seed(algo, None, None).unwrap()).unwrap(),
        )
    }

    #[test]
    fn incremental_appends_match_hashing_all_at_once() {
        let keys = RequestKeys::new(
            Some(("l".into(), "/p".into())),
            Some("salt".into()),
            vec![MmFeature { identifier: "img".into(), offset: 3, length: 9 }],
        )
        .unwrap();
        let tokens: Vec<u32> = (0..103).map(|i| i * 7919 % 100_003).collect();
        for block_size in [1, 4, 16] {
            let h = hasher(block_size);
            let expected = h.hash_blocks(&tokens, &keys);
            for prompt_len in [1, 5, 16, 50] {
                let mut seq =
                    TokenSequence::new(h.clone(), &tokens[..prompt_len], keys.clone()).unwrap();
                for t in &tokens[prompt_len..] {
                    seq.append_token_ids(&[*t]);
                }
                assert_eq!(
                    seq.block_hashes(),
                    expected.as_slice(),
                    "B={block_size} P={prompt_len}"
                );
                assert_eq!(seq.token_ids().collect::<Vec<_>>(), tokens);
            }
        }
    }

    #[test]
    fn prefix_split_and_bounds() {
        let mut seq = TokenSequence::new(hasher(2), &[1, 2, 3], RequestKeys::default()).unwrap();
        seq.append_token_ids(&[4, 5]);
        assert_eq!(seq.prefix_token_ids(2).unwrap(), (&[1u32, 2][..], None));
        assert_eq!(seq.prefix_token_ids(4).unwrap(), (&[1u32, 2, 3][..], Some(&[4u32][..])));
        assert!(seq.prefix_token_ids(6).is_err());
        assert_eq!(seq.last_token_id(), 5);
        assert_eq!(seq.block_hashes().len(), 2);
    }

    #[test]
    fn empty_prompt_is_refused() {
        assert!(TokenSequence::new(hasher(2), &[], RequestKeys::default()).is_err());
    }
}
