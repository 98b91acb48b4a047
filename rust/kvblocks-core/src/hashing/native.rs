//! The `xxh3_128` mode: kvblocks' own fast layout, hashed with XXH3-128. No Python object
//! is serialized; the bytes below are the whole contract (also in docs/hash-contract.md):
//!
//! ```text
//! block    = u64le(len(parent)) parent u64le(n) token_0 .. token_{n-1} keys
//! token    = u32le
//! keys     = 0x00                                  (no extra keys: None)
//!          | 0x01 u64le(count) key*                (a tuple of keys, possibly empty)
//! key      = 0x01 str(name) str(path)              ("lora", name, path)
//!          | 0x02 str(identifier) i64le(offset)    ("mm", identifier, offset)
//!          | 0x03 str(salt)                        ("cache_salt", salt)
//!          | 0x04 bytes(digest)                    ("prompt_embeds", digest)
//! str      = u64le(len(utf8)) utf8 ; bytes = u64le(len) raw
//! NONE_HASH = XXH3-128(utf8(seed)); every digest is the 128-bit value, big-endian.
//! ```

use super::keys::ExtraKey;

fn len(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&(n as u64).to_le_bytes());
}

fn sized(out: &mut Vec<u8>, data: &[u8]) {
    len(out, data.len());
    out.extend_from_slice(data);
}

/// The bytes of a block without extra keys up to its tokens, for a parent of `parent_len`
/// bytes (zeros, overwritten per block by the caller) and `n` tokens; returns where the
/// parent's bytes start.
pub(crate) fn plain_prefix(out: &mut Vec<u8>, parent_len: usize, n: usize) -> usize {
    len(out, parent_len);
    let at = out.len();
    out.resize(at + parent_len, 0);
    len(out, n);
    at
}

/// The rest of a block without extra keys after [`plain_prefix`], written into `buf` from
/// `at` (room for 4 bytes a token, plus 1): its tokens and `None`. Returns where it ends.
pub(crate) fn plain_rest(buf: &mut [u8], at: usize, tokens: &[u32]) -> usize {
    let end = at + 4 * tokens.len();
    if let Some(dst) = buf.get_mut(at..end) {
        write_le(dst, tokens);
    }
    if let Some(byte) = buf.get_mut(end) {
        *byte = 0x00;
    }
    end + 1
}

/// `tokens` as u32 little-endian into `dst` (exactly 4 bytes a token).
fn write_le(dst: &mut [u8], tokens: &[u32]) {
    if cfg!(target_endian = "little") {
        dst.copy_from_slice(bytemuck::cast_slice(tokens)); // already u32 little-endian
    } else {
        for (chunk, &t) in dst.chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
    }
}

fn tokens_le(out: &mut Vec<u8>, tokens: &[u32]) {
    let at = out.len();
    out.resize(at + 4 * tokens.len(), 0);
    if let Some(dst) = out.get_mut(at..) {
        write_le(dst, tokens);
    }
}

pub(crate) fn block(
    out: &mut Vec<u8>,
    parent: &[u8],
    tokens: &[u32],
    extra_keys: Option<&[ExtraKey<'_>]>,
) {
    out.reserve(17 + parent.len() + 4 * tokens.len());
    sized(out, parent);
    len(out, tokens.len());
    tokens_le(out, tokens);
    keys(out, extra_keys);
}

/// The `keys` part of the layout alone (also how a verifying block manager stores a block's
/// extra keys for exact comparison).
pub(crate) fn keys(out: &mut Vec<u8>, extra_keys: Option<&[ExtraKey<'_>]>) {
    let Some(keys) = extra_keys else {
        out.push(0x00);
        return;
    };
    out.push(0x01);
    len(out, keys.len());
    for key in keys {
        match *key {
            ExtraKey::Lora { name, path } => {
                out.push(0x01);
                sized(out, name.as_bytes());
                sized(out, path.as_bytes());
            }
            ExtraKey::Mm { identifier, offset } => {
                out.push(0x02);
                sized(out, identifier.as_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
            }
            ExtraKey::CacheSalt(salt) => {
                out.push(0x03);
                sized(out, salt.as_bytes());
            }
            ExtraKey::PromptEmbeds(digest) => {
                out.push(0x04);
                sized(out, digest);
            }
        }
    }
}
