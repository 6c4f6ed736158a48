//! The kernel registry: CUDA C++ sources embedded in the binary, compiled by NVRTC to machine
//! code (cubin) for the device's own architecture on first use, cached on disk under the quiver
//! cache folder keyed by (module, source hash, architecture, options), and loaded as modules.

use cudarc::driver::{result as dr, sys as ds};
use cudarc::nvrtc::{result as nr, sys as ns};
use quiver_backend::{KvType, KvTypes};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

const COMMON: &str = include_str!("../kernels/common.cuh");
const QUANT: &str = include_str!("../kernels/quant.cu");
const WGMMA: &str = include_str!("../kernels/wgmma.cuh");
const WMM: &str = include_str!("../kernels/wmm.cu");
const FWG: &str = include_str!("../kernels/fwg.cu");
const MMV: &str = include_str!("../kernels/mmv.cu");
const OPS: &str = include_str!("../kernels/ops.cu");
const DELTA: &str = include_str!("../kernels/delta.cu");
const DSV4: &str = include_str!("../kernels/dsv4.cu");
const FLASH: &str = include_str!("../kernels/flash.cu");
const EXACT: &str = include_str!("../kernels/exact.cu");
const QMM: &str = include_str!("../kernels/qmm.cu");
const MMVQ: &str = include_str!("../kernels/mmvq.cu");
const IMM: &str = include_str!("../kernels/imm.cu");
const IMMW: &str = include_str!("../kernels/immw.cu");
const KVQ: &str = include_str!("../kernels/kvq.cu");

/// Weight types with quantized kernels (`embed_T`, `mmv_T`, `qmm_T`), by kernel
/// suffix.
pub const QUANT_TYPES: &[&str] = &[
    "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl",
    "iq4_xs", "f32", "f16", "bf16",
];

/// Bytes and values of a block of a weight type, by kernel suffix (the float types as blocks
/// of 32 values).
pub fn block_layout(t: &str) -> Option<(usize, usize)> {
    Some(match t {
        "q4_0" => (18, 32),
        "q4_1" => (20, 32),
        "q5_0" => (22, 32),
        "q5_1" => (24, 32),
        "q8_0" => (34, 32),
        "q2_k" => (84, 256),
        "q3_k" => (110, 256),
        "q4_k" => (144, 256),
        "q5_k" => (176, 256),
        "q6_k" => (210, 256),
        "iq4_nl" => (18, 32),
        "iq4_xs" => (136, 256),
        "f32" => (128, 32),
        "f16" | "bf16" => (64, 32),
        _ => return None,
    })
}

/// Shared memory a row's weight bytes take in the qmm kernels: of one 128-column stage (qmm,
/// kernels/qmm.cu `QWin::WIN`) and of one 256-column chunk (qmv, `QWinC::WIN`).
pub fn qmm_window(t: &str) -> Option<(usize, usize)> {
    let (bb, bv) = block_layout(t)?;
    let win = |len: usize| (len + 30) / 16 * 16;
    Some(if bv == 32 {
        (win(4 * bb), win(8 * bb))
    } else {
        (win(bb), win(bb))
    })
}

/// Every module the backend can load: "ops", "exact" (the parity mode's kernels), one
/// "quant_T" per weight type and one "kvq_K_V" per pair of KV cache types (attention).
pub fn module_names() -> Vec<String> {
    let mut v = vec!["ops".to_string(), "exact".to_string()];
    v.extend(QUANT_TYPES.iter().map(|t| format!("quant_{t}")));
    v.extend(kvq_pairs().map(|(k, v)| crate::kvq::module(k, v)));
    v
}

/// Weight types the parity mode (`--numerics parity`) has products for (`x_mm_T` in the
/// "exact" module), by kernel suffix.
pub const EXACT_TYPES: &[&str] = &[
    "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
];

/// Weight types with int8 tensor-core products (`imm_T`, `imv_T` in kernels/imm.cu).
pub fn int8_mma(t: &str) -> bool {
    matches!(
        t,
        "q4_0" | "q4_1" | "q5_0" | "q8_0" | "iq4_nl" | "q4_k" | "q6_k"
    )
}

/// Types whose imm has a form on Hopper's warpgroup products (kernels/imm.cu `immw_T`).
const IMM_WGMMA_TYPES: &[&str] = &["q4_k", "q6_k"];

/// Whether imm runs on Hopper's warpgroup products (`immw_T`) for type `t` on compute
/// capability `arch`.
pub fn imm_wgmma(t: &str, arch: u32) -> bool {
    IMM_WGMMA_TYPES.contains(&t) && crate::wmm::wmm_arch(arch)
}

/// The int8 types whose imv takes the kernel table's imv token counts with
/// [`Numerics::Fast`](quiver_backend::Numerics) (measured faster than the dp4a kernels there;
/// with the batch-invariant numerics every int8 type's imv does: 8B Q4_1 at 8 sequences
/// 910 → 1,168 t/s).
pub fn imv_default(t: &str) -> bool {
    matches!(t, "q4_0" | "q8_0" | "q4_k" | "q6_k")
}

/// Weight types whose decode kernels take int8 activations: Some(32) for blocks of 32
/// (quantize_a32), Some(256) for the K-quants' blocks of 256 (quantize_a256).
pub fn int8_activations(t: &str) -> Option<usize> {
    match t {
        "q4_0" | "q4_1" | "q5_0" | "q8_0" | "iq4_nl" => Some(32),
        "q4_k" | "q6_k" | "iq4_xs" => Some(256),
        _ => None,
    }
}

/// The (K, V) type pairs with a kvq module: every pair (f16 with f16 for the kvd kernel).
fn kvq_pairs() -> impl Iterator<Item = (KvType, KvType)> {
    KvType::ALL
        .into_iter()
        .flat_map(|k| KvType::ALL.into_iter().map(move |v| (k, v)))
}

/// The kvq module's (K, V) pair.
fn kvq_pair(module: &str) -> Option<(KvType, KvType)> {
    kvq_pairs().find(|&(k, v)| crate::kvq::module(k, v) == module)
}

/// The ops module's kernels (`extern "C"`, by their own names).
const OPS_KERNELS: &[&str] = &[
    "dn_conv",
    "dn_norm",
    "sigmoid_mul",
    "hc_expand",
    "hc_pre",
    "hc_post",
    "hc_mix_part",
    "hc_mix_sum",
    "ds_prepare",
    "ds_select",
    "ds_head",
    "ds_commit",
    "ds_rewind",
    "moe_route_dsv4",
    "group_major",
    "rms_norm",
    "rope_kv_write",
    "glu",
    "softcap",
    "add",
    "tp_sum_ranks",
    "tp_gather_cols",
    "gather_rows",
    "f32_to_f16",
    "f32_permute",
    "argmax_rows",
    "quantize_a32",
    "quantize_a256",
    "f32_to_f16_q32",
    "f32_to_f16_q256",
    "topk_rows",
    "add_bias",
    "sum_splits",
    "moe_route",
    "moe_group",
    "moe_gather",
    "moe_gather_h",
    "moe_sum",
    "mask_rows",
    "scale",
    "mul_cols",
    "copy_cols",
    "put_cols",
    "copy_range",
];

/// An `extern "C"` kernel: its launch name is its name in the source.
fn plain(name: &str) -> (String, String) {
    (name.to_string(), name.to_string())
}

/// The kernels of a module, the one list the registry compiles from: each kernel's launch name
/// (what launches look it up by) and the C++ expression that names it in the module's source, a
/// template's instantiation (`mmv<Q4_K, 1, true>`) or an `extern "C"` kernel's own name. NVRTC
/// instantiates each expression (`nvrtcAddNameExpression`) and gives its lowered (mangled) name,
/// which the registry keeps beside the cubin.
pub fn kernels(module: &str) -> Vec<(String, String)> {
    if let Some((k, v)) = kvq_pair(module) {
        return attention_kernels(k, v);
    }
    match module {
        "ops" => OPS_KERNELS
            .iter()
            .map(|n| plain(n))
            .chain(crate::delta::rule_kernels())
            .collect(),
        "exact" => {
            let mut v: Vec<_> = ["x_rms_norm", "x_rope_kv_write", "x_attention", "x_glu"]
                .into_iter()
                .map(plain)
                .collect();
            // exact.cu's products: the legacy types' and the "lanes" K-quants' by their index
            // there, Q4_K's and Q6_K's own.
            const LEGACY: [&str; 5] = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"];
            const LANES: [&str; 3] = ["q2_k", "q3_k", "q5_k"];
            for t in EXACT_TYPES {
                let expr = if let Some(i) = LEGACY.iter().position(|l| l == t) {
                    format!("x_mm_legacy<{i}>")
                } else if let Some(i) = LANES.iter().position(|l| l == t) {
                    format!("x_mm_k_lanes<{i}>")
                } else {
                    format!("x_mm_{t}")
                };
                v.push((format!("x_mm_{t}"), expr));
            }
            // quant.cu's gather, compiled here without fused multiply-adds.
            v.extend(
                QUANT_TYPES
                    .iter()
                    .map(|t| (format!("x_embed_{t}"), format!("embed<{}>", weight_tag(t)))),
            );
            v
        }
        m => m
            .strip_prefix("quant_")
            .filter(|t| QUANT_TYPES.contains(t))
            .map(quant_kernels)
            .unwrap_or_default(),
    }
}

/// A kvq module's kernels for K and V types `k`, `v` (kvq.cu `KV_*`): every head dim of each
/// attention family.
fn attention_kernels(kt: KvType, vt: KvType) -> Vec<(String, String)> {
    let (k, v) = (crate::kvq::kv_type_id(kt), crate::kvq::kv_type_id(vt));
    let mut l = vec![plain("kv_encode")];
    let mut family = |name: &str, dims: &[usize]| {
        for d in dims {
            l.push((
                format!("{name}_attention_{d}"),
                format!("{name}_attention<{d}, {k}, {v}>"),
            ));
            l.push((
                format!("{name}_merge_{d}"),
                format!("{name}_merge<{d}, {v}>"),
            ));
        }
    };
    family("kvq", crate::kvq::KVQ_HEAD_DIMS);
    family("kvd", crate::plan::KVD_HEAD_DIMS);
    family("flash", crate::plan::FLASH_HEAD_DIMS);
    if crate::plan::fwg_pair(KvTypes { k: kt, v: vt }) {
        for d in crate::plan::FLASH_HEAD_DIMS {
            l.push((
                format!("fwg_attention_{d}"),
                format!("fwg_attention<{d}, {k}, {v}>"),
            ));
        }
    }
    l
}

/// A weight type's kernels (module quant_T), as templates over its tag.
fn quant_kernels(t: &str) -> Vec<(String, String)> {
    let w = weight_tag(t);
    let mut l = Vec::new();
    let mut one = |name: &str, expr: String| l.push((format!("{name}_{t}"), expr));
    one("embed", format!("embed<{w}>"));
    if t == "f32" {
        // F32 weights at f32 precision only (plan.rs): no f16 tensor-core kernels.
        one("f32mm", format!("f32mm<{w}, 8>"));
        one("f32mm1", format!("f32mm<{w}, 1>"));
    } else {
        one("qmm", format!("qmm<{w}>"));
        one("qmv", format!("qmv<{w}>"));
        one("qmm_g", format!("qmm_g<{w}>"));
        for (name, expr) in crate::wmm::wmm_kernels(&w) {
            one(&name, expr);
        }
    }
    for n in ["moe_glu", "moe_mmv", "moe_glu_g", "moe_mmv_g"] {
        one(n, format!("{n}<{w}>"));
    }
    if int8_mma(t) {
        one("imm", format!("imm<{w}>"));
        let rw = crate::imm::IMV_G_RW;
        // The K-quants' activations staged in shared memory (imm.cu `imvk_impl`, XS).
        let xs = int8_activations(t) == Some(256);
        one("imv_g", format!("imv_g<{w}, 1, {rw}, {xs}>"));
        one("imv_g2", format!("imv_g<{w}, 2, {rw}, {xs}>"));
        one("imv", format!("imv<{w}, 1>"));
        one("imv2", format!("imv<{w}, 2>"));
    }
    if IMM_WGMMA_TYPES.contains(&t) {
        one("immw", format!("immw<{w}>"));
    }
    if int8_activations(t).is_some() {
        one("mmvq_groups", format!("mmvq_groups<{w}, false>"));
        if int8_mma(t) {
            one("mmvqc_groups", format!("mmvq_groups<{w}, true>"));
        }
        for n in ["glu", "mmv"] {
            one(&format!("moeq_{n}"), format!("moeq_{n}<{w}, false>"));
            // The exact-sum order (imv_g's bits) of the int8 tensor-core types.
            if int8_mma(t) {
                one(&format!("moeqc_{n}"), format!("moeq_{n}<{w}, true>"));
            }
        }
    }
    // The matrix-vector kernels: {family}{p}{1}{_glu}_T is template{_glu}<T{order}, NTOK, PF>
    // with the prefetch (p: PF true) and one token (1: NTOK 1; else 0, the launch's count).
    let mut matvec = |family: &str, template: &str, order: &str| {
        for glu in ["", "_glu"] {
            for (p, pf) in [("", false), ("p", true)] {
                for (single, ntok) in [("", 0), ("1", 1)] {
                    l.push((
                        format!("{family}{p}{single}{glu}_{t}"),
                        format!("{template}{glu}<{w}{order}, {ntok}, {pf}>"),
                    ));
                }
            }
        }
    };
    matvec("mmv", "mmv", "");
    if int8_activations(t).is_some() {
        matvec("mmvq", "mmvq", ", false");
    }
    // The exact-sum order (mmvq.cu RowQ) of the types with int8 tensor-core products: the same
    // bits as imm.cu's.
    if int8_mma(t) {
        matvec("mmvqc", "mmvq", ", true");
    }
    l
}

/// A weight type's tag struct in the kernels (quant.cu `WEIGHT_TYPE`), by kernel suffix.
fn weight_tag(t: &str) -> String {
    t.to_uppercase()
}

/// The kernels the backend launches from a module, by launch name.
pub fn kernel_names(module: &str) -> Vec<String> {
    kernels(module).into_iter().map(|(n, _)| n).collect()
}

/// The full source NVRTC compiles for a module: common.cuh and the module's files, each after a
/// `#line` directive that names it (so that a compile error points at its file). The sources
/// define kernel templates; the module's list ([`kernels`]) instantiates them.
pub fn module_source(module: &str) -> Option<String> {
    let files: Vec<(&str, &str)> = match module {
        // The wgmma prompt kernel (fwg.cu) reads every pair CUDA holds (plan::fwg_pair).
        m if kvq_pair(m).is_some_and(|(k, v)| crate::plan::fwg_pair(KvTypes { k, v })) => vec![
            ("kvq.cu", KVQ),
            ("flash.cu", FLASH),
            ("wgmma.cuh", WGMMA),
            ("fwg.cu", FWG),
        ],
        m if kvq_pair(m).is_some() => vec![("kvq.cu", KVQ), ("flash.cu", FLASH)],
        "ops" => vec![("ops.cu", OPS), ("delta.cu", DELTA), ("dsv4.cu", DSV4)],
        // The parity mode's embedding kernels use quant.cu's dequantizers.
        "exact" => vec![("quant.cu", QUANT), ("exact.cu", EXACT)],
        m => {
            let t = m
                .strip_prefix("quant_")
                .filter(|t| QUANT_TYPES.contains(t))?;
            let mut f = vec![("quant.cu", QUANT), ("mmv.cu", MMV)];
            if int8_activations(t).is_some() {
                f.push(("mmvq.cu", MMVQ));
            }
            f.push(("qmm.cu", QMM));
            f.push(("wgmma.cuh", WGMMA));
            f.push(("wmm.cu", WMM));
            if int8_mma(t) {
                f.push(("imm.cu", IMM));
            }
            if IMM_WGMMA_TYPES.contains(&t) {
                f.push(("immw.cu", IMMW));
            }
            f
        }
    };
    let mut src = format!("#line 1 \"common.cuh\"\n{COMMON}\n");
    for (name, text) in files {
        src += &format!("#line 1 \"{name}\"\n{text}\n");
    }
    Some(src)
}

fn options(module: &str, arch: u32) -> Vec<String> {
    // Hopper's own instructions (wgmma, kernels/wmm.cu) need the architecture-specific target.
    let target = if arch == 90 {
        "sm_90a".to_string()
    } else {
        format!("sm_{arch}")
    };
    let mut o = vec![
        format!("--gpu-architecture={target}"),
        "--std=c++17".into(),
        "-default-device".into(),
        "--extra-device-vectorization".into(),
    ];
    if module == "exact" {
        // The parity mode fuses a multiply and an add only where the CPU does (explicit fmaf).
        o.push("--fmad=false".into());
    }
    if std::env::var_os("QUIVER_CUDA_LINEINFO").is_some() {
        // Source lines in the cubin, for Nsight Compute's source view (debugging).
        o.push("--generate-line-info".into());
    }
    o
}

/// A compiled module: its cubin and, for each kernel of its list ([`kernels`]), the launch name
/// and the lowered name the cubin holds it under.
#[derive(Debug)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub lowered: Vec<(String, String)>,
}

/// Compiles one module to a cubin for `sm_<arch>` (e.g. 90). Needs NVRTC, not a GPU.
/// A compile error returns the module name and NVRTC's log.
pub fn compile(module: &str, arch: u32) -> Result<Compiled, String> {
    let src = module_source(module).ok_or_else(|| format!("unknown kernel module {module}"))?;
    compile_logged(module, &src, &kernels(module), arch, false).map(|(c, _)| c)
}

/// Compiles `src` (a whole module of `extern "C"` kernels) as `module`.
pub fn compile_source(module: &str, src: &str, arch: u32) -> Result<Vec<u8>, String> {
    compile_logged(module, src, &[], arch, false).map(|(c, _)| c.cubin)
}

/// ptxas's resources per kernel of `module` (registers, spills, shared memory: its `-v`
/// report, from NVRTC's log, each kernel under its launch name), for a look at a kernel's cost
/// without a GPU.
pub fn resource_report(module: &str, arch: u32) -> Result<String, String> {
    let src = module_source(module).ok_or_else(|| format!("unknown kernel module {module}"))?;
    let (c, mut log) = compile_logged(module, &src, &kernels(module), arch, true)?;
    for (name, lowered) in &c.lowered {
        log = log.replace(&format!("'{lowered}'"), &format!("'{name}'"));
        log = log.replace(&format!(" {lowered}\n"), &format!(" {name}\n"));
    }
    Ok(log)
}

fn compile_logged(
    module: &str,
    src: &str,
    list: &[(String, String)],
    arch: u32,
    verbose: bool,
) -> Result<(Compiled, String), String> {
    crate::libs::nvrtc()?;
    let csrc = CString::new(src.to_string()).map_err(|e| e.to_string())?;
    let name = CString::new(format!("{module}.cu")).unwrap();
    let exprs: Vec<CString> = list
        .iter()
        .map(|(_, e)| CString::new(e.as_str()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let prog = nr::create_program(&csrc, Some(&name)).map_err(|e| format!("nvrtc: {e:?}"))?;
    // SAFETY: prog is a live program until destroy_program below; the expressions outlive it.
    unsafe {
        let fail = |msg: String| {
            let _ = nr::destroy_program(prog);
            Err(msg)
        };
        for e in &exprs {
            let r = ns::nvrtcAddNameExpression(prog, e.as_ptr());
            if r != ns::nvrtcResult::NVRTC_SUCCESS {
                return fail(format!(
                    "kernel module {module}: name expression {e:?}: {r:?}"
                ));
            }
        }
        let mut opts = options(module, arch);
        if verbose {
            opts.push("--ptxas-options=-v".into());
        }
        let res = nr::compile_program(prog, &opts);
        if res.is_err() {
            let log = nr::get_program_log(prog)
                .map(|l| c_log(&l))
                .unwrap_or_default();
            return fail(format!(
                "kernel module {module} failed to compile for sm_{arch}:\n{log}"
            ));
        }
        let mut lowered = Vec::with_capacity(list.len());
        for ((name, _), e) in list.iter().zip(&exprs) {
            let mut p: *const c_char = std::ptr::null();
            let r = ns::nvrtcGetLoweredName(prog, e.as_ptr(), &mut p);
            if r != ns::nvrtcResult::NVRTC_SUCCESS || p.is_null() {
                return fail(format!(
                    "kernel module {module}: no lowered name for {e:?} ({r:?})"
                ));
            }
            let l = std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
            lowered.push((name.clone(), l));
        }
        let mut size = 0usize;
        let r = ns::nvrtcGetCUBINSize(prog, &mut size);
        if r != ns::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return fail(format!(
                "kernel module {module}: NVRTC produced no cubin for sm_{arch} ({r:?})"
            ));
        }
        let mut cubin = vec![0u8; size];
        let r = ns::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char);
        let log = if verbose {
            nr::get_program_log(prog)
                .map(|l| c_log(&l))
                .unwrap_or_default()
        } else {
            String::new()
        };
        let _ = nr::destroy_program(prog);
        if r != ns::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!(
                "kernel module {module}: nvrtcGetCUBIN failed ({r:?})"
            ));
        }
        Ok((Compiled { cubin, lowered }, log))
    }
}

fn c_log(l: &[c_char]) -> String {
    let bytes: Vec<u8> = l
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).trim_end().to_string()
}

/// The NVRTC version, part of every cache key.
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    crate::libs::nvrtc()?;
    let (mut a, mut b) = (0, 0);
    // SAFETY: plain out-parameters.
    let r = unsafe { ns::nvrtcVersion(&mut a, &mut b) };
    if r != ns::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed ({r:?})"));
    }
    Ok((a, b))
}

/// Cache key: module, hash of (source, kernel list, options, NVRTC version), architecture. The
/// lowered names are stored beside the cubin ([`names_file`]).
pub fn cache_file(module: &str, arch: u32) -> Result<PathBuf, String> {
    let (a, b) = nvrtc_version()?;
    let mut h = Sha256::new();
    h.update(module_source(module).unwrap_or_default().as_bytes());
    for (name, expr) in kernels(module) {
        h.update(format!("{name}={expr};").as_bytes());
    }
    for o in options(module, arch) {
        h.update(o.as_bytes());
    }
    h.update(format!("nvrtc {a}.{b}").as_bytes());
    let hex = quiver_hub::hex(&h.finalize()[..8]);
    Ok(quiver_hub::cache_dir()
        .join("kernels")
        .join(format!("{module}-{hex}-sm{arch}.cubin")))
}

/// `c` into the disk cache at `path` (its names file first: a cubin in the cache always has
/// its names beside it); false where it could not be written.
fn store(path: &Path, c: &Compiled) -> bool {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let text: String = c
        .lowered
        .iter()
        .map(|(n, l)| format!("{n} {l}\n"))
        .collect();
    write_atomic(&names_file(path), text.as_bytes()) && write_atomic(path, &c.cubin)
}

/// Compiles `module` for `arch` into the disk cache (where a later load finds it), without a
/// GPU: a machine with NVRTC fills the cache that a GPU machine with the same NVRTC version
/// reads (tools/gpu/stage.sh --kernels). The cached file's path.
pub fn precompile(module: &str, arch: u32) -> Result<PathBuf, String> {
    let path = cache_file(module, arch)?;
    let c = compile(module, arch)?;
    if !store(&path, &c) {
        return Err(format!("could not write {}", path.display()));
    }
    Ok(path)
}

/// The file beside a cached cubin that holds its kernels' lowered names, a line
/// `launch_name lowered_name` per kernel.
pub fn names_file(cubin: &Path) -> PathBuf {
    cubin.with_extension("names")
}

/// A cache's names file read back: launch name → lowered name, `None` unless it names every
/// kernel of `module`'s list.
fn parse_names(module: &str, text: &str) -> Option<HashMap<String, String>> {
    let names: HashMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    kernels(module)
        .iter()
        .all(|(n, _)| names.contains_key(n))
        .then_some(names)
}

/// Writes `bytes` to `path` through a temporary file and a rename, so that a reader never sees
/// a partial file (another process may be compiling the same module).
fn write_atomic(path: &Path, bytes: &[u8]) -> bool {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let tmp = path.with_extension(format!("{ext}.tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_ok()
}

/// A kernel and the dynamic shared memory it has been allowed (beyond the default 48 KiB).
pub(crate) struct Func(pub ds::CUfunction, u32);
// SAFETY: CUfunction handles may be used from any thread with the context current.
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

/// Loaded modules and their functions for one context.
pub struct Registry {
    arch: u32,
    modules: HashMap<String, ds::CUmodule>,
    /// Lowered kernel names by module, then launch name.
    lowered: HashMap<String, HashMap<String, String>>,
    /// Kernels by module, then name (several modules launch the same names).
    funcs: HashMap<String, HashMap<String, Func>>,
    pub compiled: usize,
    pub from_cache: usize,
}
// SAFETY: module handles belong to the backend's context, used with it current.
unsafe impl Send for Registry {}

impl Registry {
    pub fn new(arch: u32) -> Self {
        Registry {
            arch,
            modules: HashMap::new(),
            lowered: HashMap::new(),
            funcs: HashMap::new(),
            compiled: 0,
            from_cache: 0,
        }
    }

    /// Compiles (or reads from the disk cache) and loads `module` unless it is loaded.
    pub fn ensure(&mut self, module: &str) -> Result<(), String> {
        if self.modules.contains_key(module) {
            return Ok(());
        }
        let path = cache_file(module, self.arch)?;
        let names = names_file(&path);
        let cached = match (std::fs::read(&path), std::fs::read_to_string(&names)) {
            (Ok(b), Ok(n)) if !b.is_empty() => parse_names(module, &n).map(|n| (b, n)),
            _ => None,
        };
        let (cubin, lowered) = match cached {
            Some(c) => {
                self.from_cache += 1;
                c
            }
            None => {
                let c = compile(module, self.arch)?;
                self.compiled += 1;
                store(&path, &c);
                (c.cubin, c.lowered.into_iter().collect())
            }
        };
        // SAFETY: a cubin image for this device's architecture; the driver validates it.
        let m = unsafe { dr::module::load_data(cubin.as_ptr() as *const _) }
            .map_err(|e| format!("loading kernel module {module}: {e:?}"))?;
        self.modules.insert(module.to_string(), m);
        self.lowered.insert(module.to_string(), lowered);
        Ok(())
    }

    /// A kernel of a loaded module, allowed `smem` bytes of dynamic shared memory (the
    /// attribute is set once, the first time a launch asks for more than 48 KiB).
    pub(crate) fn func(
        &mut self,
        module: &str,
        name: &str,
        smem: u32,
    ) -> Result<ds::CUfunction, String> {
        if !self.funcs.get(module).is_some_and(|m| m.contains_key(name)) {
            self.ensure(module)?;
            let m = self.modules[module];
            // A kernel outside the module's list is looked up by its own (extern "C") name.
            let lowered = self.lowered.get(module).and_then(|l| l.get(name));
            let cname = CString::new(lowered.map_or(name, String::as_str)).unwrap();
            // SAFETY: m is a loaded module.
            let f = unsafe { dr::module::get_function(m, cname) }
                .map_err(|e| format!("kernel {name} not in module {module}: {e:?}"))?;
            self.funcs
                .entry(module.to_string())
                .or_default()
                .insert(name.to_string(), Func(f, 48 << 10));
        }
        let f = self
            .funcs
            .get_mut(module)
            .and_then(|m| m.get_mut(name))
            .expect("inserted above");
        if smem > f.1 {
            // SAFETY: f.0 is a live function of a loaded module.
            unsafe {
                ds::cuFuncSetAttribute(
                    f.0,
                    ds::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .result()
            }
            .map_err(|e| format!("shared memory of kernel {name}: {e:?}"))?;
            f.1 = smem;
        }
        Ok(f.0)
    }
}

#[cfg(test)]
mod tests;
