//! The token store: a split (`train`, `eval`) as four flat little-endian files —
//! `<split>.ids` (u32 token ids), `<split>.mask` (u8 loss mask), `<split>.seg` (u16 packed
//! document index) and `<split>.offsets` (u64 row starts, rows + 1 entries) — memory-mapped when
//! read, so training never holds the whole dataset in memory.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use memmap2::Mmap;

use super::DataError;

/// Version of the token store layout. History: 1 — first version.
pub const TOKENS_VERSION: u32 = 1;

pub struct TokenWriter {
    ids: BufWriter<File>,
    mask: BufWriter<File>,
    seg: BufWriter<File>,
    offsets: Vec<u64>,
    path: String,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |e| DataError::Io { path: path.display().to_string(), source: e }
}

fn write(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |e| DataError::Write { path: path.display().to_string(), source: e }
}

impl TokenWriter {
    pub fn create(dir: &Path, split: &str) -> Result<TokenWriter, DataError> {
        let open = |ext: &str| -> Result<BufWriter<File>, DataError> {
            let p = dir.join(format!("{split}.{ext}"));
            Ok(BufWriter::new(File::create(&p).map_err(write(&p))?))
        };
        Ok(TokenWriter {
            ids: open("ids")?,
            mask: open("mask")?,
            seg: open("seg")?,
            offsets: vec![0],
            path: dir.join(split).display().to_string(),
        })
    }

    /// Append one row (a sequence the model sees as a whole).
    pub fn push(&mut self, ids: &[u32], mask: &[u8], seg: &[u16]) -> Result<(), DataError> {
        let err = |e| DataError::Write { path: self.path.clone(), source: e };
        for id in ids {
            self.ids.write_all(&id.to_le_bytes()).map_err(err)?;
        }
        self.mask.write_all(mask).map_err(err)?;
        for s in seg {
            self.seg.write_all(&s.to_le_bytes()).map_err(err)?;
        }
        let last = *self.offsets.last().expect("starts with 0");
        self.offsets.push(last + ids.len() as u64);
        Ok(())
    }

    pub fn finish(mut self, dir: &Path, split: &str) -> Result<usize, DataError> {
        let err = |e| DataError::Write { path: self.path.clone(), source: e };
        self.ids.flush().map_err(err)?;
        self.mask.flush().map_err(err)?;
        self.seg.flush().map_err(err)?;
        let p = dir.join(format!("{split}.offsets"));
        let bytes: Vec<u8> = self.offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
        std::fs::write(&p, bytes).map_err(write(&p))?;
        Ok(self.offsets.len() - 1)
    }
}

/// A split read front to back through buffered reads (ids and mask only): for one pass over a
/// store larger than memory, where a mapping would leave every page it touched resident.
pub struct SequentialReader {
    ids: std::io::BufReader<File>,
    mask: std::io::BufReader<File>,
    lengths: Vec<u64>,
    next: usize,
    path: String,
}

impl SequentialReader {
    pub fn open(dir: &Path, split: &str) -> Result<SequentialReader, DataError> {
        let open = |ext: &str| -> Result<std::io::BufReader<File>, DataError> {
            let p = dir.join(format!("{split}.{ext}"));
            Ok(std::io::BufReader::with_capacity(1 << 20, File::open(&p).map_err(io(&p))?))
        };
        let off_path = dir.join(format!("{split}.offsets"));
        let raw = std::fs::read(&off_path).map_err(io(&off_path))?;
        let offsets: Vec<u64> =
            raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let lengths = offsets.windows(2).map(|w| w[1].saturating_sub(w[0])).collect();
        Ok(SequentialReader {
            ids: open("ids")?,
            mask: open("mask")?,
            lengths,
            next: 0,
            path: dir.join(split).display().to_string(),
        })
    }

    /// The next row's ids and mask.
    pub fn next_row(&mut self) -> Result<(Vec<u32>, Vec<u8>), DataError> {
        use std::io::Read as _;
        let err = |e| DataError::Io { path: self.path.clone(), source: e };
        let n = *self.lengths.get(self.next).ok_or_else(|| DataError::Invalid {
            message: format!("token store `{}` has fewer rows than read", self.path),
            help: None,
        })? as usize;
        self.next += 1;
        let mut raw = vec![0u8; n * 4];
        self.ids.read_exact(&mut raw).map_err(err)?;
        let ids = raw.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
        let mut mask = vec![0u8; n];
        self.mask.read_exact(&mut mask).map_err(err)?;
        Ok((ids, mask))
    }
}

/// A memory-mapped split.
pub struct TokenStore {
    ids: Mmap,
    mask: Mmap,
    seg: Mmap,
    offsets: Vec<u64>,
}

/// One row as training reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRow {
    pub ids: Vec<u32>,
    pub mask: Vec<u8>,
    pub seg: Vec<u16>,
}

impl TokenStore {
    pub fn open(dir: &Path, split: &str) -> Result<TokenStore, DataError> {
        let map = |ext: &str| -> Result<Mmap, DataError> {
            let p = dir.join(format!("{split}.{ext}"));
            let f = File::open(&p).map_err(io(&p))?;
            // SAFETY: artifact files are read-only and never modified in place (the store
            // replaces whole folders by rename), so the mapping cannot change under us.
            unsafe { Mmap::map(&f) }.map_err(io(&p))
        };
        let off_path = dir.join(format!("{split}.offsets"));
        let raw = std::fs::read(&off_path).map_err(io(&off_path))?;
        let offsets: Vec<u64> =
            raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let store = TokenStore { ids: map("ids")?, mask: map("mask")?, seg: map("seg")?, offsets };
        let n = *store.offsets.last().unwrap_or(&0) as usize;
        let consistent = !store.offsets.is_empty()
            && store.offsets.windows(2).all(|w| w[0] <= w[1])
            && store.ids.len() == n * 4
            && store.mask.len() == n
            && store.seg.len() == n * 2;
        if !consistent {
            return Err(DataError::Invalid {
                message: format!("token store `{}` is inconsistent", dir.join(split).display()),
                help: Some("run `rtune cache verify`; the tokenize stage will be rebuilt".into()),
            });
        }
        Ok(store)
    }

    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens in row `i`.
    pub fn row_len(&self, i: usize) -> usize {
        (self.offsets[i + 1] - self.offsets[i]) as usize
    }

    pub fn row(&self, i: usize) -> TokenRow {
        let (a, b) = (self.offsets[i] as usize, self.offsets[i + 1] as usize);
        TokenRow {
            ids: self.ids[a * 4..b * 4]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
            mask: self.mask[a..b].to_vec(),
            seg: self.seg[a * 2..b * 2]
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes(c.try_into().expect("2 bytes")))
                .collect(),
        }
    }
}

/// Greedy packing of rows into sequences of at most `max` tokens; each row keeps its own
/// segment index so attention and positions never cross rows.
pub struct Packer {
    max: usize,
    ids: Vec<u32>,
    mask: Vec<u8>,
    seg: Vec<u16>,
}

pub type Packed = (Vec<u32>, Vec<u8>, Vec<u16>);

impl Packer {
    pub fn new(max: usize) -> Packer {
        Packer { max, ids: Vec::new(), mask: Vec::new(), seg: Vec::new() }
    }

    /// Add a row (one document); when it does not fit beside the rows held, the held rows come
    /// back as one sequence first.
    pub fn add(&mut self, ids: &[u32], mask: &[u8]) -> Option<Packed> {
        self.add_documents(ids, mask, None)
    }

    /// [`Self::add`] for a row that may already hold several documents (`seg`, a packed row's
    /// indices): each of them keeps an index of its own.
    pub fn add_documents(&mut self, ids: &[u32], mask: &[u8], seg: Option<&[u16]>) -> Option<Packed> {
        let out = if !self.ids.is_empty() && self.ids.len() + ids.len() > self.max { self.flush() } else { None };
        // Neighbouring documents only need different indices, so wrapping is fine.
        let mut s = self.seg.last().map(|s| s.wrapping_add(1)).unwrap_or(0);
        for j in 0..ids.len() {
            if j > 0 && seg.is_some_and(|seg| seg[j] != seg[j - 1]) {
                s = s.wrapping_add(1);
            }
            self.seg.push(s);
        }
        self.ids.extend(ids);
        self.mask.extend(mask);
        out
    }

    /// The rows held, as one sequence.
    pub fn flush(&mut self) -> Option<Packed> {
        if self.ids.is_empty() {
            return None;
        }
        Some((std::mem::take(&mut self.ids), std::mem::take(&mut self.mask), std::mem::take(&mut self.seg)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packer_keeps_rows_and_their_documents_apart() {
        let mut p = Packer::new(8);
        assert_eq!(p.add(&[1, 2, 3], &[1, 1, 1]), None);
        // A packed row of two documents beside it: each gets an index of its own.
        assert_eq!(p.add_documents(&[4, 5, 6, 7], &[1, 0, 1, 1], Some(&[9, 9, 3, 3])), None);
        let (ids, mask, seg) = p.add(&[8, 9], &[1, 1]).expect("does not fit: the held rows come back");
        assert_eq!((ids, mask), (vec![1, 2, 3, 4, 5, 6, 7], vec![1, 1, 1, 1, 0, 1, 1]));
        assert_eq!(seg, vec![0, 0, 0, 1, 1, 2, 2]);
        assert_eq!(p.flush(), Some((vec![8, 9], vec![1, 1], vec![0, 0])));
        assert_eq!(p.flush(), None);
    }

    #[test]
    fn write_then_map() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = TokenWriter::create(dir.path(), "train").unwrap();
        w.push(&[1, 2, 3], &[0, 1, 1], &[0, 0, 0]).unwrap();
        w.push(&[7, 8], &[1, 1], &[0, 1]).unwrap();
        assert_eq!(w.finish(dir.path(), "train").unwrap(), 2);
        let s = TokenStore::open(dir.path(), "train").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s.row(1), TokenRow { ids: vec![7, 8], mask: vec![1, 1], seg: vec![0, 1] });
        drop(s); // Windows cannot truncate a file while it is mapped.
        std::fs::write(dir.path().join("train.mask"), [0u8]).unwrap();
        assert!(TokenStore::open(dir.path(), "train").is_err());
    }
}
