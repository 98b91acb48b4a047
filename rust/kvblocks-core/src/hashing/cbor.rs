//! Canonical CBOR (RFC 8949 §4.2.1 shortest forms), exactly as `cbor2.dumps(obj,
//! canonical=True)` writes the values vLLM hashes: tuples as arrays, `bytes`, `str`,
//! integers and `None`.

use super::keys::ExtraKey;

const MAJOR_UINT: u8 = 0;
const MAJOR_NEGINT: u8 = 1;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const NULL: u8 = 0xf6;

/// Writes the initial byte of a data item and its argument in the shortest form.
fn head(out: &mut Vec<u8>, major: u8, value: u64) {
    let major = major << 5;
    if value < 24 {
        out.push(major | value as u8);
    } else if let Ok(v) = u8::try_from(value) {
        out.extend_from_slice(&[major | 24, v]);
    } else if let Ok(v) = u16::try_from(value) {
        out.push(major | 25);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(value) {
        out.push(major | 26);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(major | 27);
        out.extend_from_slice(&value.to_be_bytes());
    }
}

/// A token's encoding packed little-endian into a word (first byte lowest), and its length.
#[inline(always)]
fn packed_token(t: u32) -> (u64, usize) {
    let t64 = u64::from(t);
    match t {
        0..=23 => (t64, 1),
        24..=0xff => (24 | t64 << 8, 2),
        0x100..=0xffff => (25 | u64::from((t as u16).swap_bytes()) << 8, 3),
        _ => (26 | u64::from(t.swap_bytes()) << 8, 5),
    }
}

/// The tokens' encodings, written as whole words into a buffer sized for the longest form and
/// cut to length once: no capacity check or length update per token.
fn tokens_into(out: &mut Vec<u8>, tokens: &[u32]) {
    let start = out.len();
    out.resize(start + 5 * tokens.len() + 8, 0);
    let end = write_tokens(out, start, tokens);
    out.truncate(end);
}

/// Writes the tokens' encodings into `buf` from `at` (room for 5 bytes a token, plus 8),
/// one 8-byte word each; returns where they end.
fn write_tokens(buf: &mut [u8], mut at: usize, tokens: &[u32]) -> usize {
    for &t in tokens {
        let (word, n) = packed_token(t);
        if let Some(dst) = buf.get_mut(at..at + 8) {
            dst.copy_from_slice(&word.to_le_bytes());
        }
        at += n;
    }
    at
}

fn len(n: usize) -> u64 {
    // usize is at most 64 bits on every supported target.
    n as u64
}

fn int(out: &mut Vec<u8>, value: i64) {
    match u64::try_from(value) {
        Ok(v) => head(out, MAJOR_UINT, v),
        // -1 - value is in 0..=i64::MAX for every negative value.
        Err(_) => head(out, MAJOR_NEGINT, (-1 - value) as u64),
    }
}

fn bytes(out: &mut Vec<u8>, data: &[u8]) {
    head(out, MAJOR_BYTES, len(data.len()));
    out.extend_from_slice(data);
}

pub(crate) fn text(out: &mut Vec<u8>, s: &str) {
    head(out, MAJOR_TEXT, len(s.len()));
    out.extend_from_slice(s.as_bytes());
}

fn extra_key(out: &mut Vec<u8>, key: &ExtraKey<'_>) {
    match *key {
        ExtraKey::Lora { name, path } => {
            head(out, MAJOR_ARRAY, 3);
            text(out, key.tag());
            text(out, name);
            text(out, path);
        }
        ExtraKey::Mm { identifier, offset } => {
            head(out, MAJOR_ARRAY, 3);
            text(out, key.tag());
            text(out, identifier);
            int(out, offset);
        }
        ExtraKey::CacheSalt(salt) => {
            head(out, MAJOR_ARRAY, 2);
            text(out, key.tag());
            text(out, salt);
        }
        ExtraKey::PromptEmbeds(digest) => {
            head(out, MAJOR_ARRAY, 2);
            text(out, key.tag());
            bytes(out, digest);
        }
    }
}

/// The bytes of a block without extra keys up to its tokens, for a parent of `parent_len`
/// bytes (written as zeros: the caller overwrites them per block) and `n` tokens. Returns
/// where the parent's bytes start.
pub(crate) fn plain_prefix(out: &mut Vec<u8>, parent_len: usize, n: usize) -> usize {
    out.push(0x83);
    head(out, MAJOR_BYTES, len(parent_len));
    let at = out.len();
    out.resize(at + parent_len, 0);
    head(out, MAJOR_ARRAY, len(n));
    at
}

/// The rest of a block without extra keys after [`plain_prefix`], written into `buf` from
/// `at` (room for 5 bytes a token, plus 9): its tokens and `None`. Returns where it ends.
pub(crate) fn plain_rest(buf: &mut [u8], at: usize, tokens: &[u32]) -> usize {
    let end = write_tokens(buf, at, tokens);
    if let Some(byte) = buf.get_mut(end) {
        *byte = NULL;
    }
    end + 1
}

/// Encodes vLLM's block tuple `(parent, tuple(tokens), extra)`, where `extra` is
/// `extra_keys` itself, or with lookahead tokens the array `(extra_keys, *lookahead)` (see
/// [`super::BlockHasher::hash_lookahead_blocks_into`]).
pub(crate) fn block(
    out: &mut Vec<u8>,
    parent: &[u8],
    tokens: &[u32],
    extra_keys: Option<&[ExtraKey<'_>]>,
    lookahead: &[u32],
) {
    out.push(0x83);
    bytes(out, parent);
    head(out, MAJOR_ARRAY, len(tokens.len()));
    tokens_into(out, tokens);
    if lookahead.is_empty() {
        keys(out, extra_keys);
    } else {
        head(out, MAJOR_ARRAY, len(1 + lookahead.len()));
        keys(out, extra_keys);
        tokens_into(out, lookahead);
    }
}

/// `None`, or the array of keys.
fn keys(out: &mut Vec<u8>, extra_keys: Option<&[ExtraKey<'_>]>) {
    match extra_keys {
        None => out.push(NULL),
        Some(keys) => {
            head(out, MAJOR_ARRAY, len(keys.len()));
            for key in keys {
                extra_key(out, key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(data: &[u8]) -> String {
        data.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn encoded_int(v: i64) -> String {
        let mut out = Vec::new();
        int(&mut out, v);
        hex(&out)
    }

    #[test]
    fn integers_use_the_shortest_form() {
        // Published in docs/semantics.md §1.8 (reproduced with cbor2 in the Python tests).
        let cases = [
            (0, "00"),
            (23, "17"),
            (24, "1818"),
            (255, "18ff"),
            (256, "190100"),
            (65535, "19ffff"),
            (65536, "1a00010000"),
            (1 << 32, "1b0000000100000000"),
            (-1, "20"),
            (-24, "37"),
            (-25, "3818"),
            (-257, "390100"),
            (i64::MIN, "3b7fffffffffffffff"),
        ];
        for (value, expected) in cases {
            assert_eq!(encoded_int(value), expected, "value {value}");
        }
    }

    #[test]
    fn published_block_and_extra_key_bytes() {
        let parent = [0xabu8; 32];
        let mut out = Vec::new();
        block(&mut out, &parent, &[1, 2, 3, 300, 70000], None, &[]);
        assert_eq!(hex(&out), format!("835820{}850102031901{}", hex(&parent), "2c1a00011170f6"));

        let mut out = Vec::new();
        let keys = [
            ExtraKey::Lora { name: "L", path: "/p" },
            ExtraKey::Mm { identifier: "img0", offset: 0 },
            ExtraKey::CacheSalt("s"),
        ];
        block(&mut out, &[], &[], Some(&keys), &[]);
        let expected = "834080\
            83 83 64 6c6f7261 61 4c 62 2f70 83 62 6d6d 64 696d6730 00 82 6a 63616368655f73616c74 61 73";
        assert_eq!(hex(&out), expected.replace(' ', ""));
    }

    #[test]
    fn lookahead_extra_wraps_the_keys_and_the_tokens() {
        // Bytes from cbor2.dumps(obj, canonical=True) of
        // (b"\t\t", (1, 2), ((("mm", "aaa", -5),), 300, 70000, 2**31)) and of
        // (b"\t\t", (1, 2), (None, 5)).
        let keys = [ExtraKey::Mm { identifier: "aaa", offset: -5 }];
        let mut out = Vec::new();
        block(&mut out, &[9; 2], &[1, 2], Some(&keys), &[300, 70000, 1 << 31]);
        let expected = "834209098201028481 83626d6d63616161 24 19012c 1a00011170 1a80000000";
        assert_eq!(hex(&out), expected.replace(' ', ""));
        let mut out = Vec::new();
        block(&mut out, &[9; 2], &[1, 2], None, &[5]);
        assert_eq!(hex(&out), "8342090982010282f605");
    }

    #[test]
    fn long_arrays_and_non_ascii_strings() {
        let mut out = Vec::new();
        block(&mut out, &[], &[7; 256], Some(&[ExtraKey::CacheSalt("é")]), &[]);
        assert_eq!(hex(&out[..5]), "8340990100");
        let tail = "81 82 6a 63616368655f73616c74 62 c3a9".replace(' ', "");
        assert_eq!(hex(&out[5 + 256..]), tail);
    }
}
