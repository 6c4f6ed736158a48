//! The weights a decode step streams, copied out of the file's mapping at load into anonymous
//! memory that asks for 2 MiB pages (transparent huge pages, `madvise`): every step reads
//! every weight once, and over the file's 4 KiB pages the walks of the page tables cost
//! Gemma 3 270M's decode 10–14% on the 2-core VM (BENCHMARKS.md). Weights are packed into
//! arenas of [`ARENA_BYTES`] (a bigger one gets its own), each 64-byte aligned. Vectors (norms,
//! converted to f32 at load) are not copied, and what the host's free memory would not hold
//! with [`SPARE_BYTES`] to spare stays in the mapping (a model larger than memory keeps reading
//! through it). A tensor range is copied once: a second model over the same file (a draft
//! head's view of it) shares the copy. `QUIVER_CPU_MMAP=1`, or
//! [`crate::CpuBackend::weights_mapped`] (`--mlock`, which locks the mapping), leaves every
//! weight in the mapping.

use quiver_backend::WeightBytes;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

/// Bytes of an arena (weights this big and more get one of their own).
const ARENA_BYTES: usize = 64 << 20;

/// Host memory a copy leaves free.
const SPARE_BYTES: u64 = 1 << 30;

/// Anonymous memory that asks for huge pages, written only by `Resident::place` past what it
/// has placed (under the `Resident`'s lock), read through the ranges placed.
pub(crate) struct Arena {
    _map: memmap2::MmapMut,
    base: *mut u8,
    size: usize,
}

// SAFETY: the memory is written only through `base` past every range handed out (one writer:
// `Resident::place`, under its lock), and each range handed out is only read from then on.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

/// A weight's bytes: the file's mapping, or a copy of them in an arena.
pub(crate) enum Bytes {
    File(WeightBytes),
    Copy(Arc<Placed>),
}

/// A copy: where it lies, and its source, kept alive so that no other bytes take the source's
/// address while the copy can be found by it.
pub(crate) struct Placed {
    arena: Arc<Arena>,
    at: usize,
    len: usize,
    _src: WeightBytes,
}

impl Bytes {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Bytes::File(b) => b.bytes(),
            // SAFETY: `at..at + len` lies inside the arena the copy keeps alive, was written
            // before the copy was made and is never written again (`Arena`).
            Bytes::Copy(p) => unsafe { std::slice::from_raw_parts(p.arena.base.add(p.at), p.len) },
        }
    }
}

/// The arenas, the copies made (by the address and length of the bytes they hold).
#[derive(Default)]
pub(crate) struct Resident {
    state: Mutex<State>,
    /// Every weight stays in the mapping.
    pub(crate) mapped: bool,
}

#[derive(Default)]
struct State {
    /// The arena being filled and the bytes placed in it.
    open: Option<(Arc<Arena>, usize)>,
    copies: HashMap<(usize, usize), Weak<Placed>>,
}

impl Resident {
    /// Where a weight's bytes are read from: a copy (made now, or another weight's of the
    /// same bytes), or the mapping.
    pub(crate) fn place(&self, b: WeightBytes) -> Bytes {
        let src = b.bytes();
        let len = src.len();
        if len == 0 || self.mapped || std::env::var_os("QUIVER_CPU_MMAP").is_some_and(|v| v == "1")
        {
            return Bytes::File(b);
        }
        let key = (src.as_ptr() as usize, len);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = st.copies.get(&key).and_then(Weak::upgrade) {
            return Bytes::Copy(p);
        }
        // The open arena if the weight fits its rest, else a new one (its own if it is big).
        let (arena, at) = match st.open.as_ref() {
            Some((a, used)) if used.next_multiple_of(64) + len <= a.size => {
                (a.clone(), used.next_multiple_of(64))
            }
            _ => {
                let size = len.max(ARENA_BYTES);
                let room = quiver_backend::host_memory_available()
                    .is_some_and(|free| free >= size as u64 + SPARE_BYTES);
                let Some(a) = room.then(|| new_arena(size)).and_then(|a| a.ok()) else {
                    return Bytes::File(b);
                };
                (Arc::new(a), 0)
            }
        };
        // By parts, each part's source pages leaving the resident set once copied: the copy
        // does not hold the source and itself at once.
        for (i, part) in src.chunks(8 << 20).enumerate() {
            let dst = at + i * (8 << 20);
            // SAFETY: `at..at + len` is inside the arena and past every range handed out; this
            // thread holds the lock every writer takes.
            unsafe {
                std::ptr::copy_nonoverlapping(part.as_ptr(), arena.base.add(dst), part.len())
            };
            b.file.release(part);
        }
        if len < ARENA_BYTES {
            st.open = Some((arena.clone(), at + len));
        }
        let p = Arc::new(Placed {
            arena,
            at,
            len,
            _src: b,
        });
        st.copies.retain(|_, w| w.strong_count() > 0);
        st.copies.insert(key, Arc::downgrade(&p));
        Bytes::Copy(p)
    }
}

/// `size` bytes of anonymous memory that ask for huge pages (advice the kernel may decline:
/// the memory is then plain).
fn new_arena(size: usize) -> std::io::Result<Arena> {
    let mut map = memmap2::MmapMut::map_anon(size)?;
    let _ = map.advise(memmap2::Advice::HugePage);
    let base = map.as_mut_ptr();
    Ok(Arena {
        _map: map,
        base,
        size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use quiver_gguf::{GgmlType, GgufFile, GgufWriter};

    /// A file of a 3 MiB tensor and a 64 KiB one, random bytes as F32.
    fn file() -> Arc<GgufFile> {
        let mut w = GgufWriter::new();
        w.set(
            "general.architecture",
            quiver_gguf::Value::String("test".into()),
        );
        w.add_tensor("big", GgmlType::F32, &[768, 1024]);
        w.add_tensor("small", GgmlType::F32, &[16, 1024]);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut out = Vec::new();
        w.write(&mut out, |_, t, buf| {
            for _ in 0..t.n_elements {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                buf.extend_from_slice(&((x >> 40) as f32).to_le_bytes());
            }
            Ok(())
        })
        .unwrap();
        Arc::new(GgufFile::from_bytes(out).unwrap())
    }

    #[test]
    fn weights_are_copied_once_into_arenas() {
        let f = file();
        let r = Resident::default();
        let data = |i: usize| f.tensor_data(&f.tensors[i]);
        let (a, b, small) = (
            r.place(WeightBytes::whole(f.clone(), 0)),
            r.place(WeightBytes::whole(f.clone(), 0)),
            r.place(WeightBytes::whole(f.clone(), 1)),
        );
        for (w, i) in [(&a, 0), (&b, 0), (&small, 1)] {
            assert!(matches!(w, Bytes::Copy(_)));
            assert_eq!(w.bytes(), data(i));
            assert_ne!(w.bytes().as_ptr(), data(i).as_ptr());
            assert_eq!(w.bytes().as_ptr() as usize % 64, 0);
        }
        // One copy for the same bytes, the next weight after it in the same arena.
        assert_eq!(a.bytes().as_ptr(), b.bytes().as_ptr());
        let gap = small.bytes().as_ptr() as usize - a.bytes().as_ptr() as usize;
        assert_eq!(gap, data(0).len().next_multiple_of(64));
        // A part of a tensor is a copy of its own, of those bytes.
        let mut part = WeightBytes::whole(f.clone(), 0);
        part.range = Some((1 << 20, 2 << 20));
        let p = r.place(part);
        assert_eq!(p.bytes(), &data(0)[1 << 20..3 << 20]);
        // Kept off: the mapping's bytes.
        let mapped = Resident {
            mapped: true,
            ..Default::default()
        };
        let m = mapped.place(WeightBytes::whole(f.clone(), 0));
        assert!(matches!(m, Bytes::File(_)) && m.bytes().as_ptr() == data(0).as_ptr());
    }
}
