//! Extra keys: the per-block context that vLLM mixes into a block hash besides the tokens
//! (LoRA adapter, multimodal items, cache salt, prompt-embeds digest), and the rules that
//! decide which keys a request's block gets.

use crate::{CoreError, CoreResult};

/// One extra key, with vLLM 0.33's tagged shape. Borrowed so that hashing a block never
/// allocates: the strings live in the request ([`RequestKeys`]) or the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraKey<'a> {
    /// `("lora", lora_name, lora_path)`
    Lora { name: &'a str, path: &'a str },
    /// `("mm", identifier, offset)`, the offset relative to the block start (may be negative).
    Mm { identifier: &'a str, offset: i64 },
    /// `("cache_salt", salt)`
    CacheSalt(&'a str),
    /// `("prompt_embeds", digest)`
    PromptEmbeds(&'a [u8]),
}

impl ExtraKey<'_> {
    /// The tag string that opens the key tuple.
    pub fn tag(&self) -> &'static str {
        match self {
            Self::Lora { .. } => "lora",
            Self::Mm { .. } => "mm",
            Self::CacheSalt(_) => "cache_salt",
            Self::PromptEmbeds(_) => "prompt_embeds",
        }
    }
}

/// A multimodal item of a request: `identifier` covers tokens `[offset, offset + length)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmFeature {
    pub identifier: String,
    pub offset: usize,
    pub length: usize,
}

/// The request-level inputs of vLLM's `generate_block_hash_extra_keys`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestKeys {
    /// `(lora_name, lora_path)`
    pub lora: Option<(String, String)>,
    pub cache_salt: Option<String>,
    /// Sorted by offset (checked by [`RequestKeys::new`]).
    pub mm_features: Vec<MmFeature>,
}

impl RequestKeys {
    /// Validates the multimodal items: each must be non-empty, and they must be sorted by
    /// offset, because vLLM's block scan assumes it and would silently skip items otherwise.
    pub fn new(
        lora: Option<(String, String)>,
        cache_salt: Option<String>,
        mm_features: Vec<MmFeature>,
    ) -> CoreResult<Self> {
        let mut previous_offset = 0;
        for (i, feature) in mm_features.iter().enumerate() {
            if feature.length == 0 {
                return Err(CoreError::InvalidMmFeature(format!(
                    "item {i} ({:?}) has length 0",
                    feature.identifier
                )));
            }
            if feature.offset.checked_add(feature.length).is_none() {
                return Err(CoreError::InvalidMmFeature(format!(
                    "item {i} ({:?}) ends past the largest position",
                    feature.identifier
                )));
            }
            if feature.offset < previous_offset {
                return Err(CoreError::InvalidMmFeature(format!(
                    "items must be sorted by offset; item {i} starts at {} after an item at {}",
                    feature.offset, previous_offset
                )));
            }
            previous_offset = feature.offset;
        }
        Ok(Self { lora, cache_salt, mm_features })
    }

    /// True when no block of the request carries extra keys (the hot, common case).
    pub fn is_empty(&self) -> bool {
        self.lora.is_none()
            && self.cache_salt.as_deref().is_none_or(str::is_empty)
            && self.mm_features.is_empty()
    }

    /// Appends to `out` the keys of the block covering tokens `[start, end)`, in vLLM's order
    /// (lora, mm..., cache_salt). `mm_cursor` is the index of the next multimodal item to
    /// consider; it carries over from one block to the next exactly as vLLM's `mm_idx` does.
    pub fn block_keys<'a>(
        &'a self,
        start: usize,
        end: usize,
        mm_cursor: &mut usize,
        out: &mut Vec<ExtraKey<'a>>,
    ) {
        if let Some((name, path)) = &self.lora {
            out.push(ExtraKey::Lora { name, path });
        }
        self.mm_keys(start, end, mm_cursor, out);
        if start == 0 {
            if let Some(salt) = self.cache_salt.as_deref().filter(|s| !s.is_empty()) {
                out.push(ExtraKey::CacheSalt(salt));
            }
        }
    }

    /// The keys of a block `[start, end)` under lookahead hashing, which covers the window
    /// `[start, hash_end)`: the block's keys generated over the whole window (so an item that
    /// only overlaps the lookahead tokens counts, with its offset still relative to `start`),
    /// then `mm_cursor` moved back over the items that end after `end`. The next block starts
    /// at `end` and must see those items again; vLLM's `mm_idx` is rewound the same way.
    pub fn lookahead_block_keys<'a>(
        &'a self,
        start: usize,
        end: usize,
        hash_end: usize,
        mm_cursor: &mut usize,
        out: &mut Vec<ExtraKey<'a>>,
    ) {
        self.block_keys(start, hash_end, mm_cursor, out);
        while let Some(previous) = mm_cursor.checked_sub(1).and_then(|i| self.mm_features.get(i)) {
            if previous.offset + previous.length <= end {
                break;
            }
            *mm_cursor -= 1;
        }
    }

    fn mm_keys<'a>(
        &'a self,
        start: usize,
        end: usize,
        cursor: &mut usize,
        out: &mut Vec<ExtraKey<'a>>,
    ) {
        // Nothing left to find once the block starts at or after the end of the last item.
        match self.mm_features.last() {
            Some(last) if last.offset + last.length > start => {}
            _ => return,
        }
        while let Some(feature) = self.mm_features.get(*cursor) {
            let item_end = feature.offset + feature.length;
            if feature.offset >= end {
                break; // the block has not reached this item yet
            }
            if item_end <= start {
                *cursor += 1; // the block is past this item
                continue;
            }
            out.push(ExtraKey::Mm {
                identifier: &feature.identifier,
                offset: offset_delta(feature.offset, start),
            });
            if item_end <= end {
                *cursor += 1; // the item ends in this block; the next one may start here too
            } else {
                break; // the item continues into the next block
            }
        }
    }
}

/// `offset - start` as a signed value; positions are token indices, far below `i64::MAX`.
fn offset_delta(offset: usize, start: usize) -> i64 {
    let to_i64 = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
    to_i64(offset) - to_i64(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feature(id: &str, offset: usize, length: usize) -> MmFeature {
        MmFeature { identifier: id.to_owned(), offset, length }
    }

    fn keys_per_block(keys: &RequestKeys, block_size: usize, blocks: usize) -> Vec<Vec<String>> {
        let mut cursor = 0;
        (0..blocks)
            .map(|i| {
                let mut out = Vec::new();
                keys.block_keys(i * block_size, (i + 1) * block_size, &mut cursor, &mut out);
                out.iter().map(|k| format!("{k:?}")).collect()
            })
            .collect()
    }

    #[test]
    fn mm_offsets_are_relative_to_the_block_start() -> CoreResult<()> {
        // Item "a" spans blocks 0-1 (offset 2, length 10 with B = 8), "b" sits in block 2.
        let keys = RequestKeys::new(None, None, vec![feature("a", 2, 10), feature("b", 17, 3)])?;
        let blocks = keys_per_block(&keys, 8, 4);
        assert_eq!(blocks[0], vec![r#"Mm { identifier: "a", offset: 2 }"#]);
        assert_eq!(blocks[1], vec![r#"Mm { identifier: "a", offset: -6 }"#]);
        assert_eq!(blocks[2], vec![r#"Mm { identifier: "b", offset: 1 }"#]);
        assert!(blocks[3].is_empty());
        Ok(())
    }

    #[test]
    fn order_is_lora_mm_salt_and_salt_only_on_block_zero() -> CoreResult<()> {
        let keys = RequestKeys::new(
            Some(("L".into(), "/p".into())),
            Some("s".into()),
            vec![feature("img0", 0, 4)],
        )?;
        let blocks = keys_per_block(&keys, 4, 2);
        assert_eq!(
            blocks[0],
            vec![
                r#"Lora { name: "L", path: "/p" }"#,
                r#"Mm { identifier: "img0", offset: 0 }"#,
                r#"CacheSalt("s")"#
            ]
        );
        assert_eq!(blocks[1], vec![r#"Lora { name: "L", path: "/p" }"#]);
        Ok(())
    }

    #[test]
    fn empty_salt_adds_no_key() -> CoreResult<()> {
        let keys = RequestKeys::new(None, Some(String::new()), vec![])?;
        assert!(keys.is_empty());
        assert!(keys_per_block(&keys, 4, 1)[0].is_empty());
        Ok(())
    }

    #[test]
    fn lookahead_keys_cover_the_window_and_rewind_the_cursor() -> CoreResult<()> {
        // B = 4, L = 2: block 0 hashes [0, 6), block 1 [4, 10), block 2 [8, 14).
        // "a" = [5, 7) starts in block 1 but block 0's window already reaches it; "b" = [9, 10)
        // lies in block 2 and in block 1's lookahead.
        let keys = RequestKeys::new(None, None, vec![feature("a", 5, 2), feature("b", 9, 1)])?;
        let mut cursor = 0;
        let mut per_block = Vec::new();
        for i in 0..3 {
            let mut out = Vec::new();
            keys.lookahead_block_keys(i * 4, i * 4 + 4, i * 4 + 6, &mut cursor, &mut out);
            per_block.push((out.iter().map(|k| format!("{k:?}")).collect::<Vec<_>>(), cursor));
        }
        let mm = |id: &str, offset: i64| format!("Mm {{ identifier: {id:?}, offset: {offset} }}");
        // Block 0 sees "a" only through its lookahead; the cursor stays on "a" (it ends at 7,
        // after block 0's end 4) so block 1 sees it again.
        assert_eq!(per_block[0], (vec![mm("a", 5)], 0));
        // Block 1's window [4, 10) holds both and the scan passes both; the rewind goes back
        // over "b" (it ends at 10, after block 1's end 8) but not over "a" (ends at 7).
        assert_eq!(per_block[1], (vec![mm("a", 1), mm("b", 5)], 1));
        assert_eq!(per_block[2], (vec![mm("b", 1)], 2));
        Ok(())
    }

    #[test]
    fn unsorted_or_empty_items_are_refused() {
        let unsorted = RequestKeys::new(None, None, vec![feature("a", 5, 1), feature("b", 1, 1)]);
        assert!(matches!(unsorted, Err(CoreError::InvalidMmFeature(_))));
        let empty = RequestKeys::new(None, None, vec![feature("a", 5, 0)]);
        assert!(matches!(empty, Err(CoreError::InvalidMmFeature(_))));
    }
}
