//! Registering full blocks in the cache (vLLM's `cache_blocks`) and the `BlockStored` event
//! that reports them.

use super::verify::{key_of, Provenance};
use super::Request;
use crate::pool::{BlockPool, BlockStored, EventKey, KvEvent};
use crate::{ExtraKey, TokenSequence};

/// What registering a request's blocks touches, borrowed apart from the request table.
pub(super) struct CacheContext<'a> {
    pub pool: &'a mut BlockPool,
    pub provenance: &'a mut Option<Provenance>,
    pub debug_key_bytes: Option<usize>,
}

impl CacheContext<'_> {
    /// Registers the request's full blocks up to `num_tokens` (vLLM's `cache_blocks`), with
    /// one `BlockStored` event for the newly registered range.
    pub fn cache_blocks(self, request: &mut Request, num_tokens: usize, b: usize) {
        let hashes = request.seq.block_hashes();
        let full = num_tokens.min(hashes.len() * b) / b;
        let done = request.num_cached_blocks;
        if done >= full {
            return;
        }
        debug_assert!(request.blocks.len() >= full, "a full block below num_tokens has no block");
        for index in done..full {
            let (Some(&block), Some(hash)) = (request.blocks.get(index), hashes.get(index)) else {
                continue;
            };
            if self.pool.key(block).is_none() {
                if let Some(p) = self.provenance.as_mut() {
                    p.record(request, index, block, b);
                }
            }
            self.pool.cache_block(block, key_of(hash, self.debug_key_bytes), (index + 1) * b);
        }
        if self.pool.events_enabled() {
            self.pool.push_event(KvEvent::BlockStored(stored_event(&request.seq, done, full, b)));
        }
        request.num_cached_blocks = full;
    }
}

/// The event for blocks `done..full` of `seq`, just registered.
fn stored_event(seq: &TokenSequence, done: usize, full: usize, b: usize) -> BlockStored {
    let hashes = seq.block_hashes();
    let keys = seq.keys();
    let extra_keys = (done..full)
        .map(|index| {
            let mut extra = Vec::new();
            keys.block_keys(index * b, (index + 1) * b, &mut 0, &mut extra);
            (!extra.is_empty()).then(|| extra.iter().map(event_key).collect())
        })
        .collect();
    BlockStored {
        block_hashes: hashes.get(done..full).unwrap_or_default().to_vec(),
        parent_block_hash: done.checked_sub(1).and_then(|i| hashes.get(i)).copied(),
        token_ids: seq.tokens_in(done * b, full * b).collect(),
        block_size: b,
        lora_name: keys.lora.as_ref().map(|(name, _)| name.clone()),
        extra_keys,
    }
}

fn event_key(key: &ExtraKey<'_>) -> EventKey {
    match *key {
        ExtraKey::Lora { name, .. } => EventKey::Text(name.to_owned()),
        ExtraKey::Mm { identifier, offset } => EventKey::Mm(identifier.to_owned(), offset),
        ExtraKey::CacheSalt(salt) => EventKey::Text(salt.to_owned()),
        ExtraKey::PromptEmbeds(digest) => EventKey::Bytes(digest.to_vec()),
    }
}
