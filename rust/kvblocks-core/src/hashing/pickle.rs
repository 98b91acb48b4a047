//! Pickle protocol 5, byte for byte as CPython's C pickler writes the values vLLM hashes
//! with `pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`.
//!
//! Two CPython details matter for exact bytes:
//! - framing: after `PROTO`, output is cut into `FRAME`s; a frame is closed at the start of
//!   saving an object once it holds 64 KiB or more, a frame under 4 bytes loses its header,
//!   and a `bytes`/`str` payload of 64 KiB or more is written outside any frame;
//! - the memo: pickle writes an object seen before *by identity* as a back-reference. We
//!   model identity as vLLM's inputs have it: the four tag strings (`"lora"`, `"mm"`, ...) are
//!   interned literals shared by every key, CPython's cached singletons (the empty and
//!   one-character latin-1 `str`, the empty `bytes`) are shared, and every other string or
//!   bytes value is a distinct object, as when decoded from a request.

use super::keys::ExtraKey;

const FRAME_SIZE_TARGET: usize = 64 * 1024;
const FRAME_SIZE_MIN: usize = 4;
const FRAME_HEADER_SIZE: usize = 9;
/// The longest pickle integer of a token id: `LONG1`, a length byte and 5 bytes.
const MAX_TOKEN_BYTES: usize = 7;

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const NONE: u8 = b'N';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;

/// An object that several places of one pickle may share by identity.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shared<'a> {
    Tag(&'static str),
    Str(&'a str),
    Bytes(&'a [u8]),
}

struct Pickler<'o, 'k> {
    out: &'o mut Vec<u8>,
    /// Position of the open frame's header placeholder.
    frame_start: Option<usize>,
    memo_len: u32,
    shared: Vec<(Shared<'k>, u32)>,
}

impl<'o, 'k> Pickler<'o, 'k> {
    fn new(out: &'o mut Vec<u8>) -> Self {
        out.extend_from_slice(&[PROTO, 5]);
        Self { out, frame_start: None, memo_len: 0, shared: Vec::new() }
    }

    fn write(&mut self, data: &[u8]) {
        if self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend_from_slice(&[0; FRAME_HEADER_SIZE]);
        }
        self.out.extend_from_slice(data);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let frame_len = self.out.len() - start - FRAME_HEADER_SIZE;
        if frame_len >= FRAME_SIZE_MIN {
            let header = self.out.get_mut(start..start + FRAME_HEADER_SIZE);
            if let Some((opcode, size)) = header.and_then(|h| h.split_first_mut()) {
                *opcode = FRAME;
                size.copy_from_slice(&(frame_len as u64).to_le_bytes());
            }
        } else {
            self.out.drain(start..start + FRAME_HEADER_SIZE);
        }
    }

    /// Called as CPython's `save()` begins for each object.
    fn begin_object(&mut self) {
        if let Some(start) = self.frame_start {
            if self.out.len() - start - FRAME_HEADER_SIZE >= FRAME_SIZE_TARGET {
                self.commit_frame();
            }
        }
    }

    fn finish(mut self) {
        self.write(&[STOP]);
        self.commit_frame();
    }

    fn memoize(&mut self) {
        self.write(&[MEMOIZE]);
        self.memo_len += 1;
    }

    /// Writes a back-reference if `object` was saved before; otherwise remembers that the
    /// next memo slot will hold it.
    fn recall(&mut self, object: Option<Shared<'k>>) -> bool {
        let Some(object) = object else { return false };
        if let Some(&(_, index)) = self.shared.iter().find(|(o, _)| *o == object) {
            match u8::try_from(index) {
                Ok(i) => self.write(&[BINGET, i]),
                Err(_) => {
                    self.write(&[LONG_BINGET]);
                    self.write(&index.to_le_bytes());
                }
            }
            return true;
        }
        self.shared.push((object, self.memo_len));
        false
    }

    fn sized_payload(&mut self, opcodes: [u8; 3], data: &[u8]) {
        let n = data.len();
        let mut header = [0u8; 9];
        let header_len = if let Ok(n8) = u8::try_from(n) {
            header[0] = opcodes[0];
            header[1] = n8;
            2
        } else if let Ok(n32) = u32::try_from(n) {
            header[0] = opcodes[1];
            header[1..5].copy_from_slice(&n32.to_le_bytes());
            5
        } else {
            header[0] = opcodes[2];
            header[1..9].copy_from_slice(&(n as u64).to_le_bytes());
            9
        };
        let header = header.get(..header_len).unwrap_or_default();
        if n >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.out.extend_from_slice(header);
            self.out.extend_from_slice(data);
        } else {
            self.write(header);
            self.write(data);
        }
    }

    fn bytes(&mut self, data: &'k [u8]) {
        self.begin_object();
        let shared = data.is_empty().then_some(Shared::Bytes(data));
        if !self.recall(shared) {
            self.sized_payload([SHORT_BINBYTES, BINBYTES, BINBYTES8], data);
            self.memoize();
        }
    }

    fn text(&mut self, s: &'k str) {
        self.begin_object();
        if !self.recall(cached_str(s).then_some(Shared::Str(s))) {
            self.text_payload(s);
        }
    }

    fn tag(&mut self, tag: &'static str) {
        self.begin_object();
        if !self.recall(Some(Shared::Tag(tag))) {
            self.text_payload(tag);
        }
    }

    fn text_payload(&mut self, s: &str) {
        self.sized_payload([SHORT_BINUNICODE, BINUNICODE, BINUNICODE8], s.as_bytes());
        self.memoize();
    }

    fn int(&mut self, v: i64) {
        self.begin_object();
        if let Ok(v) = u8::try_from(v) {
            self.write(&[BININT1, v]);
        } else if let Ok(v) = u16::try_from(v) {
            self.write(&[BININT2]);
            self.write(&v.to_le_bytes());
        } else if let Ok(v) = i32::try_from(v) {
            self.write(&[BININT]);
            self.write(&v.to_le_bytes());
        } else {
            // LONG1: the shortest little-endian two's-complement form (sign bit included).
            let magnitude = if v < 0 { !v } else { v };
            let bits = 64 - magnitude.leading_zeros() + 1;
            let n = bits.div_ceil(8) as usize;
            let le = v.to_le_bytes();
            self.write(&[LONG1, n as u8]);
            self.write(le.get(..n).unwrap_or_default());
        }
    }

    /// The token ints of a tuple. When they cannot reach the frame size target, no frame can
    /// close among them, so they are written without the per-object frame check.
    fn tokens(&mut self, tokens: &[u32]) {
        let open_frame_len = match self.frame_start {
            Some(start) => self.out.len() - start - FRAME_HEADER_SIZE,
            None => FRAME_SIZE_TARGET, // no open frame: take the general path
        };
        if open_frame_len + MAX_TOKEN_BYTES * tokens.len() >= FRAME_SIZE_TARGET {
            for &t in tokens {
                self.int(i64::from(t));
            }
            return;
        }
        ints(self.out, tokens);
    }

    fn none(&mut self) {
        self.begin_object();
        self.write(&[NONE]);
    }

    /// Opens a tuple of `n` items; `close_tuple` with the same `n` ends it.
    fn open_tuple(&mut self, n: usize) {
        self.begin_object();
        if n > 3 {
            self.write(&[MARK]);
        }
    }

    fn close_tuple(&mut self, n: usize) {
        match n {
            0 => self.write(&[EMPTY_TUPLE]),
            1..=3 => {
                self.write(&[TUPLE1 + (n as u8 - 1)]);
                self.memoize();
            }
            _ => {
                self.write(&[TUPLE]);
                self.memoize();
            }
        }
    }

    /// `None`, or the tuple of keys.
    fn extra_keys(&mut self, extra_keys: Option<&[ExtraKey<'k>]>) {
        match extra_keys {
            None => self.none(),
            Some(keys) => {
                self.open_tuple(keys.len());
                for key in keys {
                    self.extra_key(key);
                }
                self.close_tuple(keys.len());
            }
        }
    }

    fn extra_key(&mut self, key: &ExtraKey<'k>) {
        let n = match key {
            ExtraKey::Lora { .. } | ExtraKey::Mm { .. } => 3,
            ExtraKey::CacheSalt(_) | ExtraKey::PromptEmbeds(_) => 2,
        };
        self.open_tuple(n);
        self.tag(key.tag());
        match *key {
            ExtraKey::Lora { name, path } => {
                self.text(name);
                self.text(path);
            }
            ExtraKey::Mm { identifier, offset } => {
                self.text(identifier);
                self.int(offset);
            }
            ExtraKey::CacheSalt(salt) => self.text(salt),
            ExtraKey::PromptEmbeds(digest) => self.bytes(digest),
        }
        self.close_tuple(n);
    }
}

/// CPython keeps one shared object for the empty string and each latin-1 character.
fn cached_str(s: &str) -> bool {
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (None, _) => true,
        (Some(c), None) => u32::from(c) < 256,
        _ => false,
    }
}

/// `pickle.dumps((parent, tuple(tokens), extra), protocol=5)`, where `extra` is
/// `extra_keys` itself, or with lookahead tokens `(extra_keys, *lookahead)` (see
/// [`super::BlockHasher::hash_lookahead_blocks_into`]). The lookahead ints are never memoized
/// (pickle memoizes no int); the wrapping tuple is, after its items, like any other tuple.
pub(crate) fn block<'k>(
    out: &mut Vec<u8>,
    parent: &'k [u8],
    tokens: &[u32],
    extra_keys: Option<&[ExtraKey<'k>]>,
    lookahead: &[u32],
) {
    let mut p = Pickler::new(out);
    p.open_tuple(3);
    p.bytes(parent);
    p.open_tuple(tokens.len());
    p.tokens(tokens);
    p.close_tuple(tokens.len());
    if lookahead.is_empty() {
        p.extra_keys(extra_keys);
    } else {
        let n = 1 + lookahead.len();
        p.open_tuple(n);
        p.extra_keys(extra_keys);
        for &t in lookahead {
            p.int(i64::from(t));
        }
        p.close_tuple(n);
    }
    p.close_tuple(3);
    p.finish();
}

/// Where a plain block's frame length sits: after `PROTO 5` and the `FRAME` opcode.
const FRAME_LEN_AT: usize = 3;

/// The bytes of a block without extra keys up to its tokens, for a parent of `parent_len`
/// bytes (zeros, overwritten per block by the caller) and `n` tokens, with the frame length
/// left for [`plain_rest`] to fill in; returns where the parent's bytes start. `None` where
/// the layout is not this fixed one: tuples of up to 3 tokens use other opcodes, a parent of
/// 256 bytes or more another header, and a block that may reach 64 KiB more frames.
pub(crate) fn plain_prefix(out: &mut Vec<u8>, parent_len: usize, n: usize) -> Option<usize> {
    let parent_len8 = u8::try_from(parent_len).ok()?;
    if n <= 3 || FRAME_HEADER_SIZE + 16 + parent_len + 7 * n >= FRAME_SIZE_TARGET {
        return None;
    }
    out.extend_from_slice(&[PROTO, 5, FRAME, 0, 0, 0, 0, 0, 0, 0, 0, SHORT_BINBYTES, parent_len8]);
    let at = out.len();
    out.resize(at + parent_len, 0);
    out.extend_from_slice(&[MEMOIZE, MARK]);
    Some(at)
}

/// The rest of a block without extra keys after [`plain_prefix`], written into `buf` from
/// `at` (room for 7 bytes a token, plus 14): its tokens, the closing opcodes of
/// `(parent, tokens, None)`, and the frame's length. Returns where it ends.
pub(crate) fn plain_rest(buf: &mut [u8], at: usize, tokens: &[u32]) -> usize {
    const CLOSE: [u8; 6] = [TUPLE, MEMOIZE, NONE, TUPLE1 + 2, MEMOIZE, STOP];
    let at = write_ints(buf, at, tokens);
    if let Some(dst) = buf.get_mut(at..at + CLOSE.len()) {
        dst.copy_from_slice(&CLOSE);
    }
    let end = at + CLOSE.len();
    let frame_len = (end - FRAME_LEN_AT - 8) as u64;
    if let Some(slot) = buf.get_mut(FRAME_LEN_AT..FRAME_LEN_AT + 8) {
        slot.copy_from_slice(&frame_len.to_le_bytes());
    }
    end
}

/// Token ids as pickle integers (`BININT1`, `BININT2`, `BININT` or `LONG1`), written into a
/// buffer sized for the longest form and cut to length once.
fn ints(out: &mut Vec<u8>, tokens: &[u32]) {
    let start = out.len();
    out.resize(start + MAX_TOKEN_BYTES * tokens.len() + 8, 0);
    let end = write_ints(out, start, tokens);
    out.truncate(end);
}

/// Writes the tokens' pickle integers into `buf` from `at` (room for 7 bytes a token, plus
/// 8), one 8-byte word each; returns where they end.
fn write_ints(buf: &mut [u8], mut at: usize, tokens: &[u32]) -> usize {
    for &t in tokens {
        let t64 = u64::from(t);
        let (word, n) = match t {
            0..=0xff => (u64::from(BININT1) | t64 << 8, 2),
            0x100..=0xffff => (u64::from(BININT2) | t64 << 8, 3),
            0x1_0000..=0x7fff_ffff => (u64::from(BININT) | t64 << 8, 5),
            _ => (u64::from(LONG1) | 5 << 8 | t64 << 16, 7),
        };
        if let Some(dst) = buf.get_mut(at..at + 8) {
            dst.copy_from_slice(&word.to_le_bytes());
        }
        at += n;
    }
    at
}

/// `pickle.dumps(s, protocol=5)` for a `str` (vLLM's NONE_HASH seed).
pub(crate) fn text(out: &mut Vec<u8>, s: &str) {
    let mut p = Pickler::new(out);
    p.begin_object();
    p.text_payload(s);
    p.finish();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(data: &[u8]) -> String {
        data.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn published_block_layout() {
        // docs/semantics.md §1.9, parent = the pickle NONE_HASH.
        let parent: Vec<u8> = (0..32).collect();
        let mut out = Vec::new();
        block(&mut out, &parent, &[1, 2, 3, 300, 70000], None, &[]);
        let expected = format!(
            "8005953800000000000000 4320{} 94 28 4b01 4b02 4b03 4d2c01 4a70110100 74 94 4e 87 94 2e",
            hex(&parent)
        );
        assert_eq!(hex(&out), expected.replace(' ', ""));
    }

    #[test]
    fn seed_string_layout() {
        let mut out = Vec::new();
        text(&mut out, "vllm-none-hash");
        assert_eq!(
            hex(&out),
            format!("8005951200000000000000 8c0e{} 94 2e", hex(b"vllm-none-hash")).replace(' ', "")
        );
    }

    #[test]
    fn repeated_tag_is_a_back_reference() {
        let keys = [
            ExtraKey::Mm { identifier: "aaa", offset: -5 },
            ExtraKey::Mm { identifier: "bbb", offset: 14 },
        ];
        let mut out = Vec::new();
        block(&mut out, &[9; 2], &[], Some(&keys), &[]);
        // memo: 0 parent, 1 "mm", 2 "aaa", 3 first key; the second "mm" is BINGET 1.
        let expected =
            "80059529000000000000004302090994 29 8c026d6d94 8c0361616194 4afbffffff 8794 \
                        6801 8c0362626294 4b0e 8794 8694 8794 2e";
        assert_eq!(hex(&out), expected.replace(" ", ""));
    }

    #[test]
    fn lookahead_extra_wraps_the_keys_and_the_tokens() {
        // Bytes from CPython's pickle.dumps(obj, protocol=5) of
        // (b"\t\t", (1, 2), ((("mm", "aaa", -5),), 300, 70000, 2**31)): four items take
        // MARK ... TUPLE, 2**31 is LONG1, and the ints are never memoized.
        let keys = [ExtraKey::Mm { identifier: "aaa", offset: -5 }];
        let mut out = Vec::new();
        block(&mut out, &[9; 2], &[1, 2], Some(&keys), &[300, 70000, 1 << 31]);
        let expected = "800595340000000000000043020909944b014b028694 28 8c026d6d94 8c0361616194 \
                        4afbffffff 8794 8594 4d2c01 4a70110100 8a050000008000 7494 8794 2e";
        assert_eq!(hex(&out), expected.replace(' ', ""));
        // (b"\t\t", (1, 2), (None, 5)): two items take TUPLE2.
        let mut out = Vec::new();
        block(&mut out, &[9; 2], &[1, 2], None, &[5]);
        assert_eq!(hex(&out), "800595130000000000000043020909944b014b0286944e4b05869487942e");
    }

    #[test]
    fn large_tokens_use_long1() {
        let mut out = Vec::new();
        block(&mut out, &[], &[u32::MAX, 1 << 31], None, &[]);
        let encoded = hex(&out);
        assert!(encoded.contains("8a05ffffffff00"), "{encoded}");
        assert!(encoded.contains("8a050000008000"), "{encoded}");
    }
}
