//! Speculative decoding's rollback of a sequence's rings: what a step's last rows overwrite
//! is kept ([`Kept`]) and written back in reverse ([`rewind`]).

use super::{layout, AttnShape};

/// Floats one row keeps for a rollback ([`attention`] with kept rows): what its position's
/// ring rows held before it wrote them — the raw window's row, the compressor's value and
/// score rows (ratio > 0), the indexer's (ratio 4).
pub fn kept_floats(s: &AttnShape) -> usize {
    let mut n = s.head_dim;
    if s.ratio > 0 {
        n += 2 * s.comp_width();
    }
    if s.ratio == 4 {
        n += 2 * 2 * s.ix_dim;
    }
    n
}

/// The ring rows position `p` writes, as (offset in the slot, length), in kept order (absent
/// rings empty).
fn ring_rows(s: &AttnShape, p: usize) -> [(usize, usize); 5] {
    let lay = layout(s);
    let mut r = [(0, 0); 5];
    r[0] = (lay[0].0 + (p % s.raw_ring()) * s.head_dim, s.head_dim);
    if s.ratio > 0 {
        let (w, ring) = (s.comp_width(), s.ring());
        r[1] = (lay[1].0 + (p % ring) * w, w);
        r[2] = (lay[2].0 + (p % ring) * w, w);
    }
    if s.ratio == 4 {
        let w = 2 * s.ix_dim;
        r[3] = (lay[4].0 + (p % 8) * w, w);
        r[4] = (lay[5].0 + (p % 8) * w, w);
    }
    r
}

/// The rows a step keeps for a rollback: `planes` rows per kept slot ([`kept_floats`] each;
/// a span's `SeqSpan::kept_slot`, none for spans that keep nothing), kept slot k's row j at
/// `(k · planes + j) · kept_floats`, row j of a span of `len` rows being
/// its row `len − planes + j` (its last `planes` rows). Each holds what that row's position's
/// ring rows held when the row wrote them (the step writes the rings in position order), so
/// that [`rewind`] can undo a span's last rows in reverse.
pub struct Kept<'a> {
    pub rows: &'a mut [f32],
    pub planes: usize,
}

impl Kept<'_> {
    /// Keeps the `parts` of position `p`'s ring rows for row `r` of a span of `len` rows in
    /// kept slot `slot` (none: [`crate::SeqSpan::NOT_KEPT`]), if the row is one of its last
    /// `planes`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn keep(
        &mut self,
        s: &AttnShape,
        slot_state: &[f32],
        slot: usize,
        len: usize,
        r: usize,
        p: usize,
        parts: std::ops::Range<usize>,
    ) {
        if r + self.planes < len || slot == crate::SeqSpan::NOT_KEPT as usize {
            return;
        }
        let j = r + self.planes - len;
        let kf = kept_floats(s);
        let row = &mut self.rows[(slot * self.planes + j) * kf..][..kf];
        let rows = ring_rows(s, p);
        let mut at: usize = rows[..parts.start].iter().map(|x| x.1).sum();
        for &(off, l) in &rows[parts] {
            row[at..at + l].copy_from_slice(&slot_state[off..off + l]);
            at += l;
        }
    }
}

/// Returns sequence slot `slot` to its state after row `row` of its last step's span of `len`
/// rows starting at position `start` (rows `row + 1 ..` undone, the last first, from the rows
/// [`Kept`] holds in kept slot `kept_slot`: at most `planes` of them). Compressed rows of blocks the undone rows
/// completed stay, unread, until their blocks complete again.
#[allow(clippy::too_many_arguments)]
pub fn rewind(
    s: &AttnShape,
    state: &mut [f32],
    kept: &[f32],
    planes: usize,
    slot: usize,
    kept_slot: usize,
    start: usize,
    len: usize,
    row: usize,
) -> Result<(), String> {
    let (sf, kf) = (s.state_floats(), kept_floats(s));
    if len > 0 && len - 1 - row.min(len - 1) > planes {
        return Err(format!(
            "{} rows to undo, {planes} kept",
            len - 1 - row.min(len - 1)
        ));
    }
    if (slot + 1) * sf > state.len() || (kept_slot + 1) * planes * kf > kept.len() {
        return Err(format!(
            "state slot {slot} or kept slot {kept_slot} past the state or its kept rows"
        ));
    }
    let st = &mut state[slot * sf..][..sf];
    for r in (row + 1..len).rev() {
        let j = r + planes - len;
        let src = &kept[(kept_slot * planes + j) * kf..][..kf];
        let mut at = 0;
        for (off, l) in ring_rows(s, start + r) {
            st[off..off + l].copy_from_slice(&src[at..at + l]);
            at += l;
        }
    }
    Ok(())
}
