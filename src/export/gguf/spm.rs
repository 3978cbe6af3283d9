//! A SentencePiece model (`tokenizer.model`): its pieces, their scores and kinds, read from the
//! protobuf (`sentencepiece_model.proto`'s `ModelProto.pieces`) as llama.cpp's converter reads
//! them with `SentencePieceProcessor` — the vocabulary a GGUF of a SentencePiece model carries
//! (Gemma, Llama 2, TinyLlama, Mistral v0.1–v0.3).

use std::path::Path;

use crate::model::ModelError;

/// A piece's kind (`ModelProto.SentencePiece.Type`; llama.cpp's token types use the same numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

/// One piece of the vocabulary, by id.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub text: String,
    pub score: f32,
    pub kind: Kind,
}

/// The pieces of the SentencePiece model at `path`, in id order.
pub fn read(path: &Path) -> Result<Vec<Piece>, ModelError> {
    let bytes = std::fs::read(path).map_err(ModelError::io(format!("cannot read `{}`", path.display())))?;
    parse(&bytes).map_err(|e| ModelError::BadFile {
        path: path.display().to_string(),
        source: format!("not a SentencePiece model: {e}").into(),
    })
}

/// The pieces of a serialized `ModelProto` (field 1, repeated; every other field skipped).
pub fn parse(bytes: &[u8]) -> Result<Vec<Piece>, String> {
    let mut pieces = Vec::new();
    let mut r = Reader { b: bytes, at: 0 };
    while !r.done() {
        let (field, wire) = r.key()?;
        match (field, wire) {
            (1, 2) => pieces.push(piece(r.bytes()?)?),
            _ => r.skip(wire)?,
        }
    }
    if pieces.is_empty() {
        return Err("it has no pieces".into());
    }
    Ok(pieces)
}

/// A `SentencePiece` message: `piece` (1), `score` (2, a float), `type` (3; NORMAL when absent).
fn piece(bytes: &[u8]) -> Result<Piece, String> {
    let mut r = Reader { b: bytes, at: 0 };
    let (mut text, mut score, mut kind) = (None, 0.0, Kind::Normal);
    while !r.done() {
        match r.key()? {
            (1, 2) => text = Some(String::from_utf8(r.bytes()?.to_vec()).map_err(|_| "a piece is not UTF-8")?),
            (2, 5) => score = f32::from_le_bytes(r.fixed::<4>()?),
            (3, 0) => {
                kind = match r.varint()? {
                    1 => Kind::Normal,
                    2 => Kind::Unknown,
                    3 => Kind::Control,
                    4 => Kind::UserDefined,
                    5 => Kind::Unused,
                    6 => Kind::Byte,
                    other => return Err(format!("a piece of unknown type {other}")),
                }
            }
            (_, wire) => r.skip(wire)?,
        }
    }
    Ok(Piece { text: text.ok_or("a piece without text")?, score, kind })
}

/// Protobuf's wire format, just what [`parse`] needs.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn done(&self) -> bool {
        self.at >= self.b.len()
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self.b.get(self.at).ok_or("truncated")?;
            self.at += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("a varint longer than 10 bytes".into())
    }

    fn key(&mut self) -> Result<(u64, u8), String> {
        let k = self.varint()?;
        Ok((k >> 3, (k & 7) as u8))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or("truncated")?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.varint()?;
        self.take(usize::try_from(n).map_err(|_| "a length beyond memory")?)
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    fn skip(&mut self, wire: u8) -> Result<(), String> {
        match wire {
            0 => self.varint().map(drop),
            1 => self.take(8).map(drop),
            2 => self.bytes().map(drop),
            5 => self.take(4).map(drop),
            other => Err(format!("wire type {other}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-encoded ModelProto: two pieces (one with every field, one with the defaults) and a
    /// trainer spec (field 2) that is skipped.
    #[test]
    fn reads_pieces_and_skips_the_rest() {
        let mut b = vec![0x12, 0x02, 0x08, 0x01]; // trainer_spec { field 1: 1 }
        let mut p = vec![0x0a, 0x03, b'<', b'a', b'>', 0x15];
        p.extend((-2.5f32).to_le_bytes());
        p.extend([0x18, 0x03]);
        b.push(0x0a);
        b.push(p.len() as u8);
        b.extend(&p);
        b.extend([0x0a, 0x03, 0x0a, 0x01, b'x']);
        let pieces = parse(&b).unwrap();
        assert_eq!(
            pieces,
            [
                Piece { text: "<a>".into(), score: -2.5, kind: Kind::Control },
                Piece { text: "x".into(), score: 0.0, kind: Kind::Normal }
            ]
        );
        assert!(parse(&b[..b.len() - 1]).unwrap_err().contains("truncated"));
        assert!(parse(&[0x12, 0x00]).unwrap_err().contains("no pieces"));
    }
}
