//! Qwen 3.5's gated delta net on the device (kernels/delta.cu): the convolution with the q/k
//! norms, and the delta rule, each sequence by its own blocks in its own order of tokens (a
//! sequence's floats do not depend on the step's other rows), and the sigmoid gate.

use crate::batch::CudaStep;
use crate::launch::grid1;
use crate::memory::CudaBuf;
use crate::weights::CudaWeight;
use crate::{check, CudaBackend};
use quiver_backend::{DeltaNetParams, DeltaNetWeights, Result, Step};

/// Widest convolution the kernel's window holds.
const MAX_CONV: usize = 8;
/// The delta rule's kernels: the widest head each holds and the lanes that share a row of its
/// matrix, 32 entries a lane (kernels/delta.cu `dn_rule<SM, H>`).
const RULE_LANES: [(&str, usize, usize); 3] = [
    ("dn_rule_32", 32, 1),
    ("dn_rule_64", 64, 2),
    ("dn_rule_128", 128, 4),
];
/// The delta rule's instances for the ops module's list: (launch name, `dn_rule<SM, H>`).
pub(crate) fn rule_kernels() -> impl Iterator<Item = (String, String)> {
    RULE_LANES
        .iter()
        .map(|&(name, sm, h)| (name.to_string(), format!("dn_rule<{sm}, {h}>")))
}
/// Widest head the delta rule's registers hold.
const MAX_HEAD: usize = RULE_LANES[2].1;

/// The grid's x of the kernels that go over a step's sequences (delta.cu `dn_seq`): the
/// sequences, or the rows in a step a graph may replay (its sequences vary under one grid; the
/// blocks past them return). A prompt of 512 rows then launches one block where it launched 512.
pub(crate) fn seq_grid(st: &Step<CudaStep>) -> u32 {
    if st.rows <= crate::graph::MAX_GRAPH_TOKENS {
        st.rows as u32
    } else {
        st.batch.seqs.len() as u32
    }
}

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn delta_net_kernel(
        &self,
        st: &Step<CudaStep>,
        p: &DeltaNetParams,
        w: DeltaNetWeights<'_, CudaWeight>,
        qkv: &mut CudaBuf,
        alpha: &CudaBuf,
        beta: &CudaBuf,
        state: &mut CudaBuf,
        snaps: Option<quiver_backend::Snapshots<'_, CudaBuf>>,
        out: &mut CudaBuf,
    ) -> Result<()> {
        let rows = st.rows;
        let (c, hv, s) = (p.channels(), p.n_v_heads, p.head_k);
        check("delta_net", p.check().is_ok(), || {
            p.check().err().unwrap_or_default()
        })?;
        check(
            "delta_net",
            qkv.len >= rows * c
                && alpha.len >= rows * hv
                && beta.len >= rows * hv
                && out.len >= rows * p.value_dim()
                && w.conv.cols == c * p.conv_kernel
                && w.dt_bias.cols == hv
                && w.a.cols == hv
                && p.conv_kernel <= MAX_CONV
                && s <= MAX_HEAD,
            || format!("{rows} rows of {c} channels, {hv} value heads of {s}"),
        )?;
        let per = p.state_floats();
        let mut slots: Vec<u32> = st.batch.seqs.iter().map(|q| q.state_slot).collect();
        slots.sort_unstable();
        check("delta_net", slots.windows(2).all(|w| w[0] != w[1]), || {
            "two sequences of the step name one state slot".into()
        })?;
        check(
            "delta_net",
            slots
                .last()
                .is_none_or(|&l| (l as usize + 1) * per <= state.len),
            || format!("a state slot past the {} slots", state.len / per.max(1)),
        )?;
        let (snap, planes) = match snaps {
            Some(sn) => {
                // The state slots' list reused: one allocation a step, as before.
                let kept = &mut slots;
                kept.clear();
                kept.extend(st.batch.seqs.iter().map(|q| q.kept_slot));
                kept.retain(|&k| k != quiver_backend::SeqSpan::NOT_KEPT);
                kept.sort_unstable();
                check(
                    "delta_net",
                    kept.windows(2).all(|w| w[0] != w[1])
                        && kept
                            .last()
                            .is_none_or(|&l| (l as usize + 1) * sn.planes * per <= sn.buf.len),
                    || {
                        format!(
                            "kept slots shared or past their buffer of {} states each",
                            sn.planes
                        )
                    },
                )?;
                (sn.buf.ptr(), sn.planes)
            }
            None => (0u64, 0),
        };
        let view = st.ctx.view;
        // Steps a graph may replay (decode; each sequence's rows in one or two rounds): a head a
        // block (its channels rounded up to warps), the q/k norms in it. Longer steps (prompts):
        // blocks of 32 channels, eight segments a round (four times the blocks and a quarter
        // of the rounds), then the norms apart (`dn_norm`: the same sums in the same order).
        let fused = st.rows <= crate::graph::MAX_GRAPH_TOKENS;
        let (width, normed) = if fused { (s, 2 * p.n_k_heads) } else { (32, 0) };
        let sw = width.div_ceil(32) * 32;
        self.launch(
            "ops",
            "dn_conv",
            (seq_grid(st), c.div_ceil(width) as u32, 1),
            (sw as u32, (256 / sw) as u32, 1),
            args![
                view,
                qkv.ptr(),
                c as i32,
                w.conv.data.ptr,
                p.conv_kernel as i32,
                state.ptr(),
                per as i64,
                snap,
                planes as i32,
                width as i32,
                normed as i32,
                p.eps
            ],
        )?;
        if !fused {
            self.launch(
                "ops",
                "dn_norm",
                (rows as u32, 2 * p.n_k_heads as u32, 1),
                (32, 1, 1),
                args![qkv.ptr(), c as i32, s as i32, p.eps],
            )?;
        }
        let &(rule, _, lanes) = RULE_LANES
            .iter()
            .find(|r| s <= r.1)
            .unwrap_or(&RULE_LANES[2]);
        self.launch(
            "ops",
            rule,
            (seq_grid(st), hv as u32, s.div_ceil(32 / lanes) as u32),
            (32, 1, 1),
            args![
                view,
                qkv.ptr(),
                c as i32,
                p.n_k_heads as i32,
                s as i32,
                alpha.ptr(),
                beta.ptr(),
                w.dt_bias.data.ptr,
                w.a.data.ptr,
                state.ptr(),
                per as i64,
                p.conv_floats() as i64,
                snap,
                planes as i32,
                out.ptr()
            ],
        )
    }

    pub(crate) fn sigmoid_mul_kernel(
        &self,
        x: &mut CudaBuf,
        gate: &CudaBuf,
        rows: usize,
        cols: usize,
        per_row: bool,
    ) -> Result<()> {
        let n = rows * cols;
        let g = if per_row { rows } else { n };
        check("sigmoid_mul", x.len >= n && gate.len >= g, || {
            format!("{rows} rows of {cols}")
        })?;
        self.launch(
            "ops",
            "sigmoid_mul",
            (grid1(n, 256, u32::MAX as usize), 1, 1),
            (256, 1, 1),
            args![
                x.ptr(),
                gate.ptr(),
                rows as i64,
                cols as i32,
                per_row as i32
            ],
        )
    }
}
