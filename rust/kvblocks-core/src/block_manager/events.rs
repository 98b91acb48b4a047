//! What the embedded manager adds when the coordinator registers a request's blocks: the full
//! `BlockStored` event (the manager owns the tokens and keys) and, with `verify_tokens`, the
//! provenance that later proves a hit holds the same tokens.

use super::verify::Provenance;
use super::Request;
use crate::kv_cache::KvCacheCoordinator;
use crate::pool::{BlockStored, EventKey, KvEvent};
use crate::{ExtraKey, TokenSequence};

/// Reports the blocks the coordinator's last call registered for `request`.
pub(super) fn report_registered(
    coordinator: &mut KvCacheCoordinator,
    request: &Request,
    provenance: Option<&mut Provenance>,
    b: usize,
) {
    if coordinator.last_registered().is_empty() {
        return;
    }
    // One full-attention group: no block is ever masked out or null.
    debug_assert!(coordinator.last_registered().iter().all(|r| r.skipped.is_empty()));
    if let Some(provenance) = provenance {
        for registered in coordinator.last_registered() {
            for index in registered.first..registered.end {
                if let Some(&block) = request.blocks().get(index) {
                    provenance.record(request, index, block, b);
                }
            }
        }
    }
    coordinator.rewrite_registered(|registered| {
        KvEvent::BlockStored(stored_event(&request.seq, registered.first, registered.end, b))
    });
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
