//! Chained block hashing with vLLM 0.33's algorithms byte for byte, plus a native fast mode.
//!
//! A block hash is `H(serialize((parent, tuple(tokens), extra_keys)))`; the parent of block 0
//! is `NONE_HASH = H(serialize(seed))`. See `docs/semantics.md` §1 for the exact rules.

mod cbor;
pub mod floor;
mod keys;
pub(crate) mod native;
mod pickle;

pub use keys::{ExtraKey, MmFeature, RequestKeys};

use crate::{CoreError, CoreResult};
use sha2::{Digest, Sha256};
use std::fmt;
use xxhash_rust::xxh3::xxh3_128;

/// The names accepted by [`HashAlgo::from_name`], in the order of [`HashAlgo`].
pub const HASH_ALGORITHMS: [&str; 5] =
    ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "xxh3_128"];

/// The seed vLLM uses for the SHA-256 algorithms when `PYTHONHASHSEED` is unset.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// A block hashing algorithm: a serialization and a digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// vLLM `sha256`: pickle protocol 5, SHA-256.
    Sha256Pickle,
    /// vLLM `sha256_cbor`: canonical CBOR, SHA-256.
    Sha256Cbor,
    /// vLLM `xxhash`: pickle protocol 5, XXH3-128.
    XxhashPickle,
    /// vLLM `xxhash_cbor`: canonical CBOR, XXH3-128.
    XxhashCbor,
    /// kvblocks `xxh3_128`: the compact native layout of `native.rs`, XXH3-128.
    Xxh3Native,
}

impl HashAlgo {
    pub fn from_name(name: &str) -> CoreResult<Self> {
        Ok(match name {
            "sha256" => Self::Sha256Pickle,
            "sha256_cbor" => Self::Sha256Cbor,
            "xxhash" => Self::XxhashPickle,
            "xxhash_cbor" => Self::XxhashCbor,
            "xxh3_128" => Self::Xxh3Native,
            other => {
                let (name, known) = (other.to_owned(), &HASH_ALGORITHMS);
                return Err(CoreError::UnknownHashAlgorithm { name, known });
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256Pickle => "sha256",
            Self::Sha256Cbor => "sha256_cbor",
            Self::XxhashPickle => "xxhash",
            Self::XxhashCbor => "xxhash_cbor",
            Self::Xxh3Native => "xxh3_128",
        }
    }

    /// Collision-resistant digests get a fixed public default seed; the others a random
    /// secret one, so that an attacker cannot precompute colliding prompts.
    pub fn is_cryptographic(self) -> bool {
        matches!(self, Self::Sha256Pickle | Self::Sha256Cbor)
    }

    /// The digest length in bytes.
    pub fn digest_size(self) -> usize {
        if self.is_cryptographic() {
            32
        } else {
            16
        }
    }

    /// Whether the algorithm has a layout for lookahead hashing: vLLM's four do (their
    /// serializations take any Python object); kvblocks' `xxh3_128` layout defines none.
    pub fn supports_lookahead(self) -> bool {
        !matches!(self, Self::Xxh3Native)
    }

    /// The bytes hashed for one block; `lookahead` is empty unless lookahead hashing is on,
    /// which [`BlockHasher::check_lookahead`] refuses before any block for `Xxh3Native`.
    fn encode_block(
        self,
        out: &mut Vec<u8>,
        parent: &[u8],
        tokens: &[u32],
        extra_keys: Option<&[ExtraKey<'_>]>,
        lookahead: &[u32],
    ) {
        out.clear();
        match self {
            Self::Sha256Pickle | Self::XxhashPickle => {
                pickle::block(out, parent, tokens, extra_keys, lookahead)
            }
            Self::Sha256Cbor | Self::XxhashCbor => {
                cbor::block(out, parent, tokens, extra_keys, lookahead)
            }
            Self::Xxh3Native => {
                debug_assert!(lookahead.is_empty(), "xxh3_128 has no lookahead layout");
                native::block(out, parent, tokens, extra_keys)
            }
        }
    }

    fn encode_seed(self, out: &mut Vec<u8>, seed: &str) {
        out.clear();
        match self {
            Self::Sha256Pickle | Self::XxhashPickle => pickle::text(out, seed),
            Self::Sha256Cbor | Self::XxhashCbor => cbor::text(out, seed),
            Self::Xxh3Native => out.extend_from_slice(seed.as_bytes()),
        }
    }

    fn digest(self, data: &[u8]) -> BlockHash {
        if self.is_cryptographic() {
            BlockHash::Sha256(Sha256::digest(data).into())
        } else {
            BlockHash::Xxh3(xxh3_128(data).to_be_bytes())
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One block hash, inline (no heap allocation per block).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockHash {
    Sha256([u8; 32]),
    Xxh3([u8; 16]),
}

impl BlockHash {
    /// A hash from its bytes: 32 (SHA-256) or 16 (XXH3-128) of them, else `None`.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if let Ok(b) = <[u8; 32]>::try_from(bytes) {
            Some(Self::Sha256(b))
        } else {
            <[u8; 16]>::try_from(bytes).ok().map(Self::Xxh3)
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Sha256(b) => b,
            Self::Xxh3(b) => b,
        }
    }

    /// vLLM's external (KV-event) form: the last 8 bytes as a big-endian unsigned integer.
    pub fn external_u64(&self) -> u64 {
        let bytes = self.as_bytes();
        let mut tail = [0u8; 8];
        if let Some(last) = bytes.get(bytes.len().saturating_sub(8)..) {
            tail.copy_from_slice(last);
        }
        u64::from_be_bytes(tail)
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The NONE_HASH seed of a vLLM process whose `PYTHONHASHSEED` is `env_seed`, where another
/// process (a router, a frontend) can know it: the variable verbatim, else the fixed default
/// for SHA-256; `None` for a non-cryptographic algorithm without it (vLLM draws a random
/// secret then).
pub fn known_seed(algo: HashAlgo, env_seed: Option<String>) -> Option<String> {
    env_seed.or_else(|| algo.is_cryptographic().then(|| DEFAULT_SEED.to_owned()))
}

/// Resolves the NONE_HASH seed exactly as vLLM's `init_none_hash`: an explicit seed, else
/// `PYTHONHASHSEED` (`env_seed`, used verbatim), else the fixed default for SHA-256 and a
/// fresh random 64-hex-digit secret for the non-cryptographic algorithms.
pub fn resolve_seed(
    algo: HashAlgo,
    explicit: Option<String>,
    env_seed: Option<String>,
) -> CoreResult<String> {
    if let Some(seed) = known_seed(algo, explicit.or(env_seed)) {
        return Ok(seed);
    }
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|e| CoreError::Randomness(e.to_string()))?;
    Ok(secret.iter().map(|b| format!("{b:02x}")).collect())
}

/// Hashes blocks with one algorithm, block size and seed. Immutable and `Sync`: share it.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    algo: HashAlgo,
    block_size: usize,
    seed: String,
    none_hash: BlockHash,
}

impl BlockHasher {
    /// `seed` must already be resolved (see [`resolve_seed`]).
    pub fn new(algo: HashAlgo, block_size: usize, seed: String) -> CoreResult<Self> {
        if block_size == 0 {
            return Err(CoreError::InvalidSize { what: "block_size (must be >= 1)", value: 0 });
        }
        let mut scratch = Vec::new();
        algo.encode_seed(&mut scratch, &seed);
        let none_hash = algo.digest(&scratch);
        Ok(Self { algo, block_size, seed, none_hash })
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn seed(&self) -> &str {
        &self.seed
    }

    pub fn none_hash(&self) -> &BlockHash {
        &self.none_hash
    }

    /// vLLM's `hash_block_tokens`: the hash of one block given its parent's hash. A missing
    /// or empty parent means NONE_HASH. Like vLLM, the token count is not checked against
    /// the block size. `scratch` is reused between calls to avoid allocation.
    pub fn hash_block(
        &self,
        parent: Option<&[u8]>,
        tokens: &[u32],
        extra_keys: Option<&[ExtraKey<'_>]>,
        scratch: &mut Vec<u8>,
    ) -> BlockHash {
        self.hash_block_with_lookahead(parent, tokens, extra_keys, &[], scratch)
    }

    /// [`BlockHasher::hash_block`] with the block's lookahead tokens (empty: none).
    fn hash_block_with_lookahead(
        &self,
        parent: Option<&[u8]>,
        tokens: &[u32],
        extra_keys: Option<&[ExtraKey<'_>]>,
        lookahead: &[u32],
        scratch: &mut Vec<u8>,
    ) -> BlockHash {
        let parent = match parent {
            Some(p) if !p.is_empty() => p,
            _ => self.none_hash.as_bytes(),
        };
        self.algo.encode_block(scratch, parent, tokens, extra_keys, lookahead);
        self.algo.digest(scratch)
    }

    /// The chained hash of every full block of `tokens`, with the extra keys vLLM would
    /// generate for a request with `keys`.
    pub fn hash_blocks(&self, tokens: &[u32], keys: &RequestKeys) -> Vec<BlockHash> {
        self.hash_blocks_from(tokens, 0, None, keys)
    }

    /// Continues a chain: the hashes of the full blocks of `tokens`, which start at block
    /// `first_block` of the request (token `first_block * block_size`), the first of them
    /// chained to `parent` (`None` or empty: NONE_HASH). Extra keys follow the absolute
    /// positions, so the result equals the tail of [`BlockHasher::hash_blocks`] over the whole
    /// sequence whenever `parent` is that sequence's hash of block `first_block - 1`.
    pub fn hash_blocks_from(
        &self,
        tokens: &[u32],
        first_block: usize,
        parent: Option<&[u8]>,
        keys: &RequestKeys,
    ) -> Vec<BlockHash> {
        let mut hashes: Vec<BlockHash> = Vec::new();
        self.hash_blocks_into(tokens, first_block, parent, keys, &mut hashes);
        hashes
    }

    /// [`BlockHasher::hash_blocks_from`] into any [`HashSink`] (for instance one flat table
    /// of digests, with no per-block value kept). `sink` must start empty.
    pub fn hash_blocks_into(
        &self,
        tokens: &[u32],
        first_block: usize,
        parent: Option<&[u8]>,
        keys: &RequestKeys,
        sink: &mut impl HashSink,
    ) {
        sink.reserve(tokens.len() / self.block_size);
        if keys.is_empty() && self.hash_plain(tokens, parent, sink) {
            return;
        }
        let mut chain = HashChain { blocks_done: first_block, ..HashChain::default() };
        for block in tokens.chunks_exact(self.block_size) {
            let hash = chain.next(self, sink.last_hash().or(parent), block, keys);
            sink.push(&hash);
        }
    }

    /// Refuses lookahead hashing where the algorithm has no layout for it (`xxh3_128`).
    pub fn check_lookahead(&self, num_lookahead_tokens: usize) -> CoreResult<()> {
        if num_lookahead_tokens == 0 || self.algo.supports_lookahead() {
            return Ok(());
        }
        Err(CoreError::InvalidArgument(format!(
            "num_lookahead_tokens={num_lookahead_tokens}: the {} layout has no lookahead form; \
             lookahead hashing needs one of vLLM's algorithms (sha256, sha256_cbor, xxhash, \
             xxhash_cbor)",
            self.algo
        )))
    }

    /// [`BlockHasher::hash_blocks_into`] with vLLM's lookahead hashing (EAGLE/MTP,
    /// `num_hash_lookahead_tokens = L`; `L = 0` is plain hashing). Each block's hash also
    /// covers the `L` tokens after it, so a block is hashed only once those exist
    /// (`block_end + L <= tokens.len()`); its tokens are still the hashed tokens, and the third
    /// item of its tuple becomes `(E, t_1, ..., t_L)`: `E` the extra keys (or `None`) of the
    /// window `[block_start, block_end + L)`, the `t_i` the tokens after the block. Multimodal
    /// items in the window count; the scan resumes at the first item the next block can see
    /// (see [`RequestKeys::lookahead_block_keys`]). `sink` must start empty; on an error
    /// (`xxh3_128` with `L > 0`) nothing is pushed.
    pub fn hash_lookahead_blocks_into(
        &self,
        tokens: &[u32],
        first_block: usize,
        parent: Option<&[u8]>,
        keys: &RequestKeys,
        num_lookahead_tokens: usize,
        sink: &mut impl HashSink,
    ) -> CoreResult<()> {
        if num_lookahead_tokens == 0 {
            self.hash_blocks_into(tokens, first_block, parent, keys, sink);
            return Ok(());
        }
        self.check_lookahead(num_lookahead_tokens)?;
        let size = self.block_size;
        let hashed = tokens.len().saturating_sub(num_lookahead_tokens);
        sink.reserve(hashed / size);
        let offset = first_block.saturating_mul(size);
        let (mut scratch, mut extra, mut mm_cursor) = (Vec::new(), Vec::new(), 0);
        for (index, block) in
            tokens.get(..hashed).unwrap_or_default().chunks_exact(size).enumerate()
        {
            let end = (index + 1) * size;
            let lookahead = tokens.get(end..end + num_lookahead_tokens).unwrap_or_default();
            extra.clear();
            if !keys.is_empty() {
                let (start, end) = (offset.saturating_add(end - size), offset.saturating_add(end));
                let window_end = end.saturating_add(num_lookahead_tokens);
                keys.lookahead_block_keys(start, end, window_end, &mut mm_cursor, &mut extra);
            }
            let extra = (!extra.is_empty()).then_some(extra.as_slice());
            let parent = sink.last_hash().or(parent);
            let hash =
                self.hash_block_with_lookahead(parent, block, extra, lookahead, &mut scratch);
            sink.push(&hash);
        }
        Ok(())
    }

    /// The hot case of [`BlockHasher::hash_blocks_from`]: blocks without extra keys. Their
    /// bytes before the tokens depend only on the parent's length (and, for pickle, a frame
    /// length filled in per block), so that part is written once and only the parent's bytes
    /// are overwritten per block. Returns false, having done nothing, where it does not apply.
    fn hash_plain(&self, tokens: &[u32], parent: Option<&[u8]>, out: &mut impl HashSink) -> bool {
        let size = self.algo.digest_size();
        let parent = match parent {
            Some(p) if !p.is_empty() => p,
            _ => self.none_hash.as_bytes(),
        };
        if parent.len() != size || out.last_hash().is_some() {
            return false;
        }
        let mut buf = Vec::with_capacity(64 + size + 5 * self.block_size);
        match self.algo {
            HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor => {
                let at = cbor::plain_prefix(&mut buf, size, self.block_size);
                self.chain_plain(tokens, parent, buf, at, cbor::plain_rest, out);
            }
            HashAlgo::Xxh3Native => {
                let at = native::plain_prefix(&mut buf, size, self.block_size);
                self.chain_plain(tokens, parent, buf, at, native::plain_rest, out);
            }
            HashAlgo::Sha256Pickle | HashAlgo::XxhashPickle => {
                let Some(at) = pickle::plain_prefix(&mut buf, size, self.block_size) else {
                    return false;
                };
                self.chain_plain(tokens, parent, buf, at, pickle::plain_rest, out);
            }
        }
        true
    }

    /// The loop of [`BlockHasher::hash_plain`], compiled once per layout (`rest` inlined).
    /// The buffer keeps room for the longest block, so each block only overwrites its parent
    /// and its tokens and digests the bytes up to where `rest` says they end.
    fn chain_plain(
        &self,
        tokens: &[u32],
        parent: &[u8],
        mut buf: Vec<u8>,
        parent_at: usize,
        rest: impl Fn(&mut [u8], usize, &[u32]) -> usize,
        out: &mut impl HashSink,
    ) {
        let prefix_len = buf.len();
        buf.resize(prefix_len + 7 * self.block_size + 16, 0);
        for block in tokens.chunks_exact(self.block_size) {
            let parent_bytes = out.last_hash().unwrap_or(parent);
            if let Some(slot) = buf.get_mut(parent_at..parent_at + parent_bytes.len()) {
                slot.copy_from_slice(parent_bytes);
            }
            let end = rest(&mut buf, prefix_len, block);
            out.push(&self.algo.digest(buf.get(..end).unwrap_or_default()));
        }
    }
}

/// Where a chain of block hashes goes, and where the next block finds its parent.
pub trait HashSink {
    /// Makes room for `num_hashes` more.
    fn reserve(&mut self, num_hashes: usize);
    fn push(&mut self, hash: &BlockHash);
    /// The bytes of the last hash pushed, if any.
    fn last_hash(&self) -> Option<&[u8]>;
}

impl HashSink for Vec<BlockHash> {
    fn reserve(&mut self, num_hashes: usize) {
        Vec::reserve(self, num_hashes);
    }

    fn push(&mut self, hash: &BlockHash) {
        Vec::push(self, *hash);
    }

    fn last_hash(&self) -> Option<&[u8]> {
        self.as_slice().last().map(BlockHash::as_bytes)
    }
}

/// Block hashes as one table of bytes, `width` (the digest size) per hash.
#[derive(Debug, Clone, Default)]
pub struct HashTable {
    pub bytes: Vec<u8>,
    pub width: usize,
}

impl HashTable {
    pub fn with_capacity(num_hashes: usize, width: usize) -> Self {
        Self { bytes: Vec::with_capacity(num_hashes * width), width }
    }

    pub fn len(&self) -> usize {
        self.bytes.len().checked_div(self.width).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

impl HashSink for HashTable {
    fn reserve(&mut self, num_hashes: usize) {
        self.bytes.reserve(num_hashes * self.width);
    }

    fn push(&mut self, hash: &BlockHash) {
        self.bytes.extend_from_slice(hash.as_bytes());
    }

    fn last_hash(&self) -> Option<&[u8]> {
        self.bytes
            .len()
            .checked_sub(self.width)
            .and_then(|start| self.bytes.get(start..))
            .filter(|last| !last.is_empty())
    }
}

/// The running state of an incremental chain: the multimodal cursor and a reusable
/// serialization buffer.
#[derive(Debug, Default, Clone)]
pub(crate) struct HashChain {
    mm_cursor: usize,
    scratch: Vec<u8>,
    blocks_done: usize,
}

impl HashChain {
    /// Hashes the next block of the chain, whose predecessor has hash `parent`.
    pub(crate) fn next(
        &mut self,
        hasher: &BlockHasher,
        parent: Option<&[u8]>,
        block: &[u32],
        keys: &RequestKeys,
    ) -> BlockHash {
        let hash = if keys.is_empty() {
            hasher.hash_block(parent, block, None, &mut self.scratch)
        } else {
            let start = self.blocks_done * hasher.block_size;
            let mut extra = Vec::new();
            keys.block_keys(start, start + block.len(), &mut self.mm_cursor, &mut extra);
            let extra = (!extra.is_empty()).then_some(extra.as_slice());
            hasher.hash_block(parent, block, extra, &mut self.scratch)
        };
        self.blocks_done += 1;
        hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(h: &BlockHash) -> String {
        format!("{h:?}")
    }

    fn hasher(algo: &str, block_size: usize) -> BlockHasher {
        let algo = HashAlgo::from_name(algo).unwrap();
        BlockHasher::new(algo, block_size, DEFAULT_SEED.to_owned()).unwrap()
    }

    #[test]
    fn published_none_hashes() {
        // docs/semantics.md §1.2 (seed "vllm-none-hash").
        let cases = [
            ("sha256", "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"),
            ("sha256_cbor", "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"),
            ("xxhash", "d98f72b9c430d985211489af307f0229"),
            ("xxhash_cbor", "a4e364baa0791a6f63bbf917db9b700d"),
        ];
        for (algo, expected) in cases {
            assert_eq!(hex(hasher(algo, 16).none_hash()), expected, "{algo}");
        }
    }

    #[test]
    fn published_chained_sha256_cbor_vectors() {
        // docs/semantics.md §1.8.
        let h = hasher("sha256_cbor", 5);
        let mut scratch = Vec::new();
        let h0 = h.hash_block(None, &[1, 2, 3, 300, 70000], None, &mut scratch);
        assert_eq!(hex(&h0), "64a2177cdc4ad13cf6ff4c78a138c067abc894a027eb7755378d1ce49db50e0d");
        let h1 = h.hash_block(Some(h0.as_bytes()), &[4, 5, 6, 7, 8], None, &mut scratch);
        assert_eq!(hex(&h1), "f68aa1ec5519be54e8ad54458b4bac1c35fd8ad26ce57beae235d321810563c7");
        assert_eq!(h0.external_u64(), 4002887412026248717);

        let h4 = hasher("sha256_cbor", 4);
        let chain = h4.hash_blocks(&[0, 1, 2, 3, 4, 5, 6, 7, 8], &RequestKeys::default());
        assert_eq!(
            chain.iter().map(hex).collect::<Vec<_>>(),
            [
                "c49ab11fb576db6f376aef58c24f728a0ba1807e8cac5f940f1a5c4c20741898",
                "9d0a7c928c548f9aeea31ae98471cf515045a206851732ac14cb3083c18d40f9"
            ]
        );

        let salted = RequestKeys::new(None, Some("salt1".into()), vec![]).unwrap();
        let chain = h4.hash_blocks(&[1, 2, 3, 4], &salted);
        assert_eq!(
            hex(&chain[0]),
            "59f237785cf5c5448048dd9a9303b769f819ecae82c1d363df0e182e59b5c42b"
        );
    }

    #[test]
    fn published_pickle_vector() {
        let h = hasher("sha256", 5);
        let h0 = h.hash_block(None, &[1, 2, 3, 300, 70000], None, &mut Vec::new());
        assert_eq!(hex(&h0), "060e374a2428d3ade297b9b4f3bf39df08580aa75cc8d93f5983e9f8b10b08a0");
    }

    /// LoRA ("L", "/p"), salt "salt", images "img0" at [3, 9) and "img1" at [13, 15).
    fn lora_salt_and_two_images() -> RequestKeys {
        let mm = vec![
            MmFeature { identifier: "img0".into(), offset: 3, length: 6 },
            MmFeature { identifier: "img1".into(), offset: 13, length: 2 },
        ];
        RequestKeys::new(Some(("L".into(), "/p".into())), Some("salt".into()), mm).unwrap()
    }

    #[test]
    fn continued_chain_equals_the_tail_of_the_whole_chain() {
        let keys = lora_salt_and_two_images();
        let tokens: Vec<u32> = (0..23).collect();
        for algo in HASH_ALGORITHMS {
            let h = hasher(algo, 4);
            let whole = h.hash_blocks(&tokens, &keys);
            assert_eq!(whole.len(), 5);
            for first in 0..=whole.len() {
                let parent = first.checked_sub(1).and_then(|i| whole.get(i)).map(|p| p.as_bytes());
                let tail = h.hash_blocks_from(&tokens[first * 4..], first, parent, &keys);
                assert_eq!(tail, whole[first..], "{algo} from block {first}");
            }
        }
    }

    fn lookahead_chain(
        h: &BlockHasher,
        tokens: &[u32],
        keys: &RequestKeys,
        l: usize,
    ) -> Vec<String> {
        let mut out: Vec<BlockHash> = Vec::new();
        h.hash_lookahead_blocks_into(tokens, 0, None, keys, l, &mut out).unwrap();
        out.iter().map(hex).collect()
    }

    #[test]
    fn lookahead_vectors_from_vllm() {
        // vLLM 0.33's get_request_block_hasher(4, hash_fn, 2) on requests with these tokens
        // and keys (PYTHONHASHSEED unset, so seed "vllm-none-hash"): tokens 0..22 with LoRA
        // ("L", "/p"), salt "salt" and images "img0" at [3, 9), "img1" at [13, 15); then 0..9
        // with no keys. Five and two blocks: a block needs the 2 tokens after it.
        let keys = lora_salt_and_two_images();
        let tokens: Vec<u32> = (0..23).collect();
        let plain: Vec<u32> = (0..10).collect();
        let none = RequestKeys::default();
        let cbor = hasher("sha256_cbor", 4);
        assert_eq!(
            lookahead_chain(&cbor, &tokens, &keys, 2),
            [
                "9bcc88f692035c83d16d3418eaa2f32c1288f53db3e288ad6acc21bf9c4c9277",
                "f3e7ee7c3a7917b5cd3b53ca196569697f8db714e8dd2872f0bca9fdc11c0fec",
                "9979382e35655e7d78a46301f9f3875179ae990a65cf3a16effd26f85638f3ea",
                "f0f89db2bccb4e37436e5bdf78ba3453338a2594ee8f284a12d979cd155af353",
                "6f5c7a951ddf93a54fd5bc44274ef74f90b545bf994bbca29dd43c20ccdf935f",
            ]
        );
        assert_eq!(
            lookahead_chain(&cbor, &plain, &none, 2),
            [
                "90edc544853ac3c1ab8f14e5bcb6c8f2f0de5f874b842cbfc2549717850ad2bc",
                "7adc9e136df5c7fc7a28b617c608a21f7aeb60639e1ddccbca90268da5899f03",
            ]
        );
        let pickle = hasher("sha256", 4);
        assert_eq!(
            lookahead_chain(&pickle, &tokens, &keys, 2),
            [
                "b72f5c9cedf854d768b6aca95ba8d8d860eca0fc8688e6149cfec1d86d55e8ea",
                "1dc52d6d434a3426555cc94b68ba98756593d607b75063e35b9823e2c294ea42",
                "f6fa0bf1045999d3983cfc483b3da63a17a1ab757aea4ebfa173ea0aff2d2ded",
                "256defb633b4be59728f9b9e09fc61a6a02043b3d9497bd2d8817b08e4797c5a",
                "97fb0bc24a55c6f30559af9be39e438660f5f81e20748b9b2844e235187015e5",
            ]
        );
        assert_eq!(
            lookahead_chain(&pickle, &plain, &none, 2),
            [
                "a5d56154b5566c8347b3616d5e2ec0c0155a4e8c11ecd22e872549508adf7981",
                "0f35138df3dc798be49b78cd273b2a95fb6435790f239dbbeedc5cb206a5b14f",
            ]
        );
    }

    #[test]
    fn lookahead_continued_chain_equals_the_tail_of_the_whole_chain() {
        let mm = vec![
            MmFeature { identifier: "a".into(), offset: 2, length: 3 },
            MmFeature { identifier: "b".into(), offset: 6, length: 1 },
            MmFeature { identifier: "c".into(), offset: 7, length: 9 },
        ];
        let keys = RequestKeys::new(None, Some("s".into()), mm).unwrap();
        let tokens: Vec<u32> = (100..126).collect();
        for algo in ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] {
            let h = hasher(algo, 4);
            for l in [1, 2, 3, 5] {
                let mut whole: Vec<BlockHash> = Vec::new();
                h.hash_lookahead_blocks_into(&tokens, 0, None, &keys, l, &mut whole).unwrap();
                assert_eq!(whole.len(), (26 - l) / 4, "{algo}, L = {l}");
                assert_ne!(whole, h.hash_blocks(&tokens, &keys)[..whole.len()]);
                for first in 0..=whole.len() {
                    let parent = first.checked_sub(1).map(|i| whole[i].as_bytes());
                    let mut tail: Vec<BlockHash> = Vec::new();
                    let rest = &tokens[first * 4..];
                    h.hash_lookahead_blocks_into(rest, first, parent, &keys, l, &mut tail).unwrap();
                    assert_eq!(tail, whole[first..], "{algo}, L = {l}, from block {first}");
                }
            }
        }
    }

    #[test]
    fn lookahead_is_refused_for_the_native_layout_and_zero_is_plain_hashing() {
        let h = hasher("xxh3_128", 4);
        let keys = RequestKeys::default();
        let mut out: Vec<BlockHash> = Vec::new();
        let err = h.hash_lookahead_blocks_into(&[1, 2, 3], 0, None, &keys, 1, &mut out);
        assert!(matches!(err, Err(CoreError::InvalidArgument(_))), "{err:?}");
        assert!(out.is_empty());
        let tokens: Vec<u32> = (0..9).collect();
        h.hash_lookahead_blocks_into(&tokens, 0, None, &keys, 0, &mut out).unwrap();
        assert_eq!(out, h.hash_blocks(&tokens, &keys));
    }

    #[test]
    fn plain_fast_path_equals_the_general_encoder() {
        // Every integer width of CBOR and pickle, including pickle's LONG1 above 2^31 - 1.
        let widths = [0, 23, 24, 255, 256, 65_535, 65_536, 0x7fff_ffff, 0x8000_0000, u32::MAX];
        let tokens: Vec<u32> =
            (0..70).map(|i| widths.get(i % 10).copied().unwrap_or(0) ^ (i as u32 % 3)).collect();
        for algo in HASH_ALGORITHMS {
            for block_size in [1, 3, 16, 30] {
                let h = hasher(algo, block_size);
                let size = h.algo().digest_size();
                for parent in [None, Some(vec![7u8; size]), Some(vec![7u8; size + 1])] {
                    let fast =
                        h.hash_blocks_from(&tokens, 0, parent.as_deref(), &RequestKeys::default());
                    let mut chain = HashChain::default();
                    let mut general: Vec<BlockHash> = Vec::new();
                    for block in tokens.chunks_exact(block_size) {
                        let p = general.last().map(BlockHash::as_bytes).or(parent.as_deref());
                        general.push(chain.next(&h, p, block, &RequestKeys::default()));
                    }
                    assert_eq!(fast, general, "{algo}, block size {block_size}, {parent:?}");
                }
            }
        }
    }

    #[test]
    fn empty_parent_means_none_hash() {
        let h = hasher("xxh3_128", 2);
        let mut scratch = Vec::new();
        let a = h.hash_block(None, &[1, 2], None, &mut scratch);
        let b = h.hash_block(Some(&[]), &[1, 2], None, &mut scratch);
        let c = h.hash_block(Some(h.none_hash().as_bytes()), &[1, 2], None, &mut scratch);
        assert_eq!(a, b);
        assert_eq!(a, c);
    }

    #[test]
    fn seed_rules() {
        let sha = HashAlgo::Sha256Cbor;
        let xx = HashAlgo::XxhashCbor;
        assert_eq!(resolve_seed(sha, None, None).unwrap(), DEFAULT_SEED);
        assert_eq!(resolve_seed(sha, None, Some("0".into())).unwrap(), "0");
        assert_eq!(resolve_seed(xx, Some("s".into()), Some("0".into())).unwrap(), "s");
        let a = resolve_seed(xx, None, None).unwrap();
        let b = resolve_seed(xx, None, None).unwrap();
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }

    #[test]
    fn zero_block_size_is_refused() {
        let err = BlockHasher::new(HashAlgo::Sha256Cbor, 0, DEFAULT_SEED.into()).unwrap_err();
        assert!(matches!(err, CoreError::InvalidSize { .. }));
        assert!(matches!(HashAlgo::from_name("md5"), Err(CoreError::UnknownHashAlgorithm { .. })));
    }
}
