//! The step's batch on the device: `begin_step` uploads the batch's index arrays in one copy
//! (the `BatchView` every kernel takes), the flash kernel's query tiles, and picks the step's
//! graph.

use crate::dev::DevBuf;
use crate::graph::{self, graph_bucket};
use crate::kinds::{has_prompt_rows, leading_decode_rows, Kinds};
use crate::{derr, CudaBackend};
use quiver_backend::{BackendError, Batch, Result, SeqSpan, Step};
use std::sync::atomic::Ordering;

/// Where each region of the uploaded batch starts (u32 offsets), for `cap_t` tokens.
#[derive(Clone, Copy, Default)]
pub(crate) struct BatchLayout {
    pub(crate) cap_t: usize,
    pub(crate) cap_s: usize,
    pub(crate) cap_bt: usize,
}

impl BatchLayout {
    fn words(&self) -> usize {
        5 * self.cap_t + 6 * self.cap_s + self.cap_bt
    }
}

/// The batch as the kernels see it (mirrors `BatchView` in common.cuh).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct BatchView {
    pub(crate) tokens: u64,
    pub(crate) pos: u64,
    pub(crate) slot: u64,
    pub(crate) seq: u64,
    pub(crate) logit_rows: u64,
    pub(crate) kv_len: u64,
    pub(crate) bt_off: u64,
    pub(crate) block_tables: u64,
    /// The rows a kernel launched over a subset of the step takes (0: rows 0..): the decode
    /// rows of a mixed step for the KV-group kernel.
    pub(crate) drows: u64,
    /// Per sequence, its slot of the recurrent state (SeqSpan::state_slot).
    pub(crate) state_slot: u64,
    /// Per sequence, where it keeps what a rollback needs (SeqSpan::kept_slot).
    pub(crate) kept_slot: u64,
    /// Per sequence, its first row and its rows (`SeqSpan::start`, `len`; 0 past the step's
    /// sequences): the kernels whose grid goes over the sequences (delta.cu).
    pub(crate) seq_row: u64,
    pub(crate) seq_rows: u64,
    pub(crate) block_size: u32,
}

impl Default for BatchView {
    fn default() -> Self {
        BatchView {
            tokens: 0,
            pos: 0,
            slot: 0,
            seq: 0,
            logit_rows: 0,
            kv_len: 0,
            bt_off: 0,
            block_tables: 0,
            drows: 0,
            state_slot: 0,
            kept_slot: 0,
            seq_row: 0,
            seq_rows: 0,
            block_size: 1,
        }
    }
}

/// Where the current step's batch lives on the device: reused from step to step. Ops get the
/// step's [`CudaStep`] from `begin_step`; the products, which take no step, read its `kinds`.
#[derive(Default)]
pub(crate) struct StepState {
    /// The step's rows by kind (kinds.rs).
    pub(crate) kinds: Kinds,
    /// The uploaded batch (`layout`) and its host staging.
    buf: Option<DevBuf>,
    layout: BatchLayout,
    host: Vec<u32>,
    /// The flash kernel's query tiles ({seq, first token, tokens, 0}: the prompt rows' first,
    /// then the decode rows'), the decode rows, and their device copy (tiles, then rows).
    tiles: Vec<[i32; 4]>,
    drows: Vec<u32>,
    /// Host staging of the tiles and rows (reused: no allocation per step).
    flat: Vec<i32>,
    tile_buf: Option<DevBuf>,
}

/// The CUDA backend's part of a step (`Backend::StepCtx`): the batch as the kernels see it.
#[derive(Clone, Copy)]
pub struct CudaStep {
    pub(crate) view: BatchView,
    /// Logits rows are rows 0.. of the step (no gather before the output product).
    pub(crate) logits_identity: bool,
    /// The flash kernel's tiles on the device and their count (None: split-K attention).
    pub(crate) tiles: Option<Tiles>,
    /// In a step of both kinds (`SeqSpan::decode_from`), its decode rows: the KV-group kernel
    /// takes them and the flash kernel the prompt rows' tiles, so that a decode row's
    /// attention is the same bits as in a decode step. None: one kind.
    pub(crate) decode_rows: Option<DecodeRows>,
}

/// The flash kernel's query tiles on the device and their count.
pub(crate) type Tiles = (u64, usize);

/// A mixed step's decode rows for the KV-group kernel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeRows {
    /// The row indices on the device, and their count.
    pub(crate) list: u64,
    pub(crate) count: usize,
    /// The prompt rows' tiles, which lead the step's tiles.
    pub(crate) prompt_tiles: usize,
}

impl CudaStep {
    /// Query tiles the flash kernel runs this step (0: split-K attention).
    pub fn flash_tiles(&self) -> usize {
        self.tiles.map_or(0, |t| t.1)
    }
}

impl std::fmt::Debug for CudaStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStep")
            .field("logits_identity", &self.logits_identity)
            .field("tiles", &self.tiles.map(|t| t.1))
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// `Backend::begin_step`: uploads the batch, decides the step's rows and kernels, and
    /// replays or captures its graph when it has one.
    pub(crate) fn begin<'b>(
        &mut self,
        batch: &'b Batch,
        state: u64,
        max_tokens: usize,
        max_logits: usize,
    ) -> Result<Step<'b, CudaStep>> {
        self.dev.bind().map_err(BackendError::Device)?;
        let n = batch.n_tokens();
        let nl = batch.logits.len();
        // Decode-shaped steps (every token wants logits, none known to be a prompt row) pad to
        // a bucket and run from a graph.
        let prompt_rows = has_prompt_rows(batch);
        let shaped = graph_bucket(n, nl, max_tokens, max_logits).filter(|_| !prompt_rows);
        let decode_shaped = shaped.is_some();
        let bucket = shaped.filter(|_| self.graphs.enabled());
        let graphable = bucket.is_some();
        let (rows, logit_rows) = match bucket {
            Some(b) => (b, b),
            None => (n, nl),
        };

        let (view, logits_identity) = self.upload_batch(batch, rows, logit_rows, max_tokens)?;
        // Flash attention for prefill-shaped steps only, decided by the batch's shape (not by
        // whether graphs are on), so that eager and replayed steps run the same kernels.
        self.step.kinds = Kinds {
            rows,
            decode: if decode_shaped {
                rows
            } else {
                leading_decode_rows(batch)
            },
        };
        let (tiles, decode_rows) =
            if !decode_shaped && (prompt_rows || batch.seqs.iter().any(|s| s.len > 1)) {
                self.upload_tiles(batch)?
            } else {
                (None, None)
            };
        let step = Step {
            batch,
            rows,
            logit_rows,
            replayed: false,
            ctx: CudaStep {
                view,
                logits_identity,
                tiles,
                decode_rows,
            },
        };
        if !graphable {
            self.graphs.stats.eager += 1;
            return Ok(step);
        }
        let generation = self.generation.load(Ordering::Relaxed);
        self.graphs.retain_generation(generation);
        let key = graph::Key {
            state,
            rows,
            generation,
        };
        match self
            .graphs
            .begin(key, self.dev.stream)
            .map_err(|e| derr("graph", e))?
        {
            graph::Begin::Replayed => Ok(Step {
                replayed: true,
                ..step
            }),
            graph::Begin::Capturing | graph::Begin::Eager => Ok(step),
        }
    }

    /// Query tiles of up to 64 consecutive tokens per sequence for the flash kernel (none:
    /// split-K kernel, when a sequence's positions are not consecutive), and in a step of both
    /// kinds its decode rows ([`CudaStep::decode_rows`]).
    fn upload_tiles(&mut self, batch: &Batch) -> Result<(Option<Tiles>, Option<DecodeRows>)> {
        let s = &mut self.step;
        let Some(n_prompt) = query_tiles(batch, &mut s.tiles, &mut s.drows) else {
            return Ok((None, None));
        };
        if n_prompt == 0 && !s.drows.is_empty() {
            // Decode rows only (a recompute's generated tokens): the KV-group kernel, as in
            // decode steps.
            return Ok((None, None));
        }
        s.flat.clear();
        s.flat.extend(s.tiles.iter().flatten());
        s.flat.extend(s.drows.iter().map(|&r| r as i32));
        let bytes = s.flat.len() * 4;
        if s.tile_buf.as_ref().is_none_or(|b| b.bytes < bytes) {
            let b = self.alloc(bytes.next_power_of_two().max(4096), "attention tiles")?;
            self.step.tile_buf = Some(b);
        }
        let s = &self.step;
        let ptr = s.tile_buf.as_ref().unwrap().ptr;
        self.dev
            .htod_async(ptr, &s.flat)
            .map_err(BackendError::Device)?;
        let drows = (n_prompt > 0 && !s.drows.is_empty()).then(|| DecodeRows {
            list: ptr + 16 * s.tiles.len() as u64,
            count: s.drows.len(),
            prompt_tiles: n_prompt,
        });
        Ok((Some((ptr, s.tiles.len())), drows))
    }

    fn upload_batch(
        &mut self,
        batch: &Batch,
        rows: usize,
        logit_rows: usize,
        max_tokens: usize,
    ) -> Result<(BatchView, bool)> {
        let n = batch.n_tokens();
        let n_seqs = batch.seqs.len();
        let bt_total: usize = batch
            .seqs
            .iter()
            .map(|s| s.block_table.len())
            .sum::<usize>()
            + 1;
        let need = BatchLayout {
            cap_t: rows.max(max_tokens.min(4096)).max(logit_rows),
            cap_s: n_seqs + 1,
            cap_bt: bt_total,
        };
        let s = &mut self.step;
        let l = &s.layout;
        if s.buf.is_none() || need.cap_t > l.cap_t || need.cap_s > l.cap_s || need.cap_bt > l.cap_bt
        {
            let grown = BatchLayout {
                cap_t: need.cap_t.max(l.cap_t),
                cap_s: need.cap_s.max(l.cap_s).next_power_of_two().max(64),
                cap_bt: need.cap_bt.max(l.cap_bt).next_power_of_two().max(1024),
            };
            let buf = self
                .dev
                .alloc(grown.words() * 4)
                .map_err(BackendError::Device)?;
            s.buf = Some(buf);
            s.layout = grown;
            self.generation.fetch_add(1, Ordering::Relaxed);
        }
        let l = s.layout;
        let (ct, cs) = (l.cap_t, l.cap_s);
        let h = &mut s.host;
        h.clear();
        h.resize(5 * ct + 6 * cs + bt_total, 0);
        let dummy = n_seqs as u32;
        for t in 0..rows {
            if t < n {
                h[t] = batch.tokens[t];
                h[ct + t] = batch.positions[t];
                h[2 * ct + t] = batch.slots[t];
                h[3 * ct + t] = batch.seq_of[t];
            } else {
                h[2 * ct + t] = u32::MAX;
                h[3 * ct + t] = dummy;
            }
        }
        for i in 0..logit_rows {
            h[4 * ct + i] = batch.logits.get(i).copied().unwrap_or(i as u32);
        }
        let logits_identity = (0..logit_rows).all(|i| h[4 * ct + i] as usize == i);
        let mut off = 0u32;
        for (si, sq) in batch.seqs.iter().enumerate() {
            h[5 * ct + si] = sq.kv_len as u32;
            h[5 * ct + cs + si] = off;
            h[5 * ct + 2 * cs + si] = sq.state_slot;
            h[5 * ct + 3 * cs + si] = sq.kept_slot;
            h[5 * ct + 4 * cs + si] = sq.start as u32;
            h[5 * ct + 5 * cs + si] = sq.len as u32;
            let b = 5 * ct + 6 * cs + off as usize;
            h[b..b + sq.block_table.len()].copy_from_slice(&sq.block_table);
            off += sq.block_table.len() as u32;
        }
        // The padding sequence: no keys.
        h[5 * ct + n_seqs] = 0;
        h[5 * ct + cs + n_seqs] = off;
        let base = s.buf.as_ref().unwrap().ptr;
        self.dev.htod_async(base, h).map_err(BackendError::Device)?;
        let at = |w: usize| base + 4 * w as u64;
        let view = BatchView {
            tokens: at(0),
            pos: at(ct),
            slot: at(2 * ct),
            seq: at(3 * ct),
            logit_rows: at(4 * ct),
            kv_len: at(5 * ct),
            bt_off: at(5 * ct + cs),
            state_slot: at(5 * ct + 2 * cs),
            kept_slot: at(5 * ct + 3 * cs),
            seq_row: at(5 * ct + 4 * cs),
            seq_rows: at(5 * ct + 5 * cs),
            block_tables: at(5 * ct + 6 * cs),
            drows: 0,
            block_size: batch.block_size as u32,
        };
        Ok((view, logits_identity))
    }
}

/// The flash kernel's query tiles: up to 64 consecutive tokens of one sequence each,
/// `{sequence, first token, tokens, 0}`, first those of the prompt rows (positions before the
/// span's `decode_from`), then those of the decode rows, which go to `drows` too. The number of
/// prompt tiles; None (and no tiles) when a sequence's positions are not consecutive, which
/// the kernel assumes.
pub(crate) fn query_tiles(
    batch: &Batch,
    tiles: &mut Vec<[i32; 4]>,
    drows: &mut Vec<u32>,
) -> Option<usize> {
    tiles.clear();
    drows.clear();
    // A span's prompt rows: its first `np` (positions before `decode_from`).
    let np = |sp: &SeqSpan| {
        let first = batch.positions.get(sp.start).map_or(0, |&p| p as usize);
        sp.decode_from.saturating_sub(first).min(sp.len)
    };
    // Rows a..b of span si, in tiles of up to 64.
    fn push(tiles: &mut Vec<[i32; 4]>, si: usize, sp: &SeqSpan, a: usize, b: usize) {
        for c in (a..b).step_by(64) {
            tiles.push([si as i32, (sp.start + c) as i32, (b - c).min(64) as i32, 0]);
        }
    }
    for (si, sp) in batch.seqs.iter().enumerate() {
        let pos = &batch.positions[sp.start..sp.start + sp.len];
        if pos
            .iter()
            .enumerate()
            .any(|(i, &p)| p as usize != pos[0] as usize + i)
        {
            tiles.clear();
            return None;
        }
        push(tiles, si, sp, 0, np(sp));
    }
    let n_prompt = tiles.len();
    for (si, sp) in batch.seqs.iter().enumerate() {
        let p = np(sp);
        push(tiles, si, sp, p, sp.len);
        drows.extend((sp.start + p..sp.start + sp.len).map(|r| r as u32));
    }
    Some(n_prompt)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A batch of spans (tokens, first position, `decode_from`), positions consecutive.
    pub(crate) fn spans(spans: &[(usize, u32, usize)]) -> Batch {
        let mut b = Batch {
            block_size: 16,
            ..Default::default()
        };
        for &(len, p0, decode_from) in spans {
            let start = b.tokens.len();
            let si = b.seqs.len() as u32;
            b.seqs.push(SeqSpan {
                start,
                len,
                kv_len: p0 as usize + len,
                decode_from,
                ..Default::default()
            });
            for i in 0..len {
                b.tokens.push(0);
                b.positions.push(p0 + i as u32);
                b.seq_of.push(si);
            }
        }
        b
    }

    #[test]
    fn query_tiles_cover_every_token_once_in_runs_of_64() {
        // A 150-token prefill from position 10, a 1-token decode, a 64-token chunk.
        let mut b = spans(&[
            (150, 10, usize::MAX),
            (1, 70, usize::MAX),
            (64, 0, usize::MAX),
        ]);
        let (mut t, mut d) = (Vec::new(), Vec::new());
        assert_eq!(query_tiles(&b, &mut t, &mut d), Some(5));
        assert!(d.is_empty(), "no span says where its decode rows begin");
        assert_eq!(
            t,
            vec![
                [0, 0, 64, 0],
                [0, 64, 64, 0],
                [0, 128, 22, 0],
                [1, 150, 1, 0],
                [2, 151, 64, 0]
            ]
        );
        let mut covered = vec![0; b.tokens.len()];
        for [_, first, n, _] in &t {
            for c in &mut covered[*first as usize..(*first + *n) as usize] {
                *c += 1;
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
        // The first span recomputes 60 generated tokens (its prompt: 100), the second decodes:
        // their decode rows get tiles of their own, after the prompt rows'.
        b.seqs[0].decode_from = 100;
        b.seqs[1].decode_from = 70;
        b.seqs[2].decode_from = 64;
        assert_eq!(query_tiles(&b, &mut t, &mut d), Some(3));
        assert_eq!(
            t,
            vec![
                [0, 0, 64, 0],
                [0, 64, 26, 0],
                [2, 151, 64, 0],
                [0, 90, 60, 0],
                [1, 150, 1, 0]
            ]
        );
        assert_eq!(d, (90..151).collect::<Vec<u32>>());
        b.positions[3] = 99;
        assert!(
            query_tiles(&b, &mut t, &mut d).is_none() && t.is_empty() && d.is_empty(),
            "non-consecutive positions fall back"
        );
    }
}
