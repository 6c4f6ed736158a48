//! The kernel registry: CUDA C++ sources embedded in the binary, compiled by NVRTC to machine
//! code (cubin) for the device's own architecture on first use, cached on disk under the quiver
//! cache folder keyed by (module, source hash, architecture, options), and loaded as modules.

use cudarc::driver::{result as dr, sys as ds};
use cudarc::nvrtc::{result as nr, sys as ns};
use quiver_backend::KvType;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::PathBuf;

const COMMON: &str = include_str!("../kernels/common.cuh");
const QUANT: &str = include_str!("../kernels/quant.cu");
const OPS: &str = include_str!("../kernels/ops.cu");
const FLASH: &str = include_str!("../kernels/flash.cu");
const EXACT: &str = include_str!("../kernels/exact.cu");
const QMM: &str = include_str!("../kernels/qmm.cu");
const MMVQ: &str = include_str!("../kernels/mmvq.cu");
const IMM: &str = include_str!("../kernels/imm.cu");
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

/// The int8 types whose imv takes the kernel table's imv token counts with
/// [`Numerics::Fast`](quiver_backend::Numerics) (measured faster than the dp4a kernels there;
/// with the batch-invariant numerics every int8 type's imv does: 8B Q4_1 at 8 sequences
/// 910 → 1,168 t/s).
pub fn imv_default(t: &str) -> bool {
    matches!(t, "q4_0" | "q8_0" | "q4_k" | "q6_k")
}

/// 1 for the int8 types whose block term has an offset (Q4_1's min against the activations'
/// q8_1 sums: mmvq.cu `term32`), 0 for the others.
fn int8_offset(t: &str) -> u8 {
    u8::from(t == "q4_1")
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

/// The kernels the backend launches from a module.
pub fn kernel_names(module: &str) -> Vec<String> {
    if kvq_pair(module).is_some() {
        let mut v = vec!["kv_encode".to_string()];
        for d in crate::kvq::KVQ_HEAD_DIMS {
            v.push(format!("kvq_attention_{d}"));
            v.push(format!("kvq_merge_{d}"));
        }
        for d in crate::plan::KVD_HEAD_DIMS {
            v.push(format!("kvd_attention_{d}"));
            v.push(format!("kvd_merge_{d}"));
        }
        for d in crate::plan::FLASH_HEAD_DIMS {
            v.push(format!("flash_attention_{d}"));
            v.push(format!("flash_merge_{d}"));
        }
        return v;
    }
    match module {
        "ops" => [
            "rms_norm",
            "rope_kv_write",
            "glu",
            "softcap",
            "add",
            "gather_rows",
            "f32_to_f16",
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
            "moe_tiles",
            "moe_gather_h",
            "moe_sum",
            "mask_rows",
            "scale",
            "mul_cols",
            "copy_cols",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        "exact" => {
            let mut v: Vec<String> = ["x_rms_norm", "x_rope_kv_write", "x_attention", "x_glu"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            v.extend(EXACT_TYPES.iter().map(|t| format!("x_mm_{t}")));
            v.extend(QUANT_TYPES.iter().map(|t| format!("x_embed_{t}")));
            v
        }
        m => {
            let t = m.strip_prefix("quant_").unwrap_or(m);
            let mut v: Vec<String> = [
                "embed",
                "qmm",
                "qmv",
                "qmm_g",
                "mmv",
                "mmv1",
                "mmv_glu",
                "mmv1_glu",
                "mmvp",
                "mmvp1",
                "mmvp_glu",
                "mmvp1_glu",
                "moe_glu",
                "moe_mmv",
                "moe_glu_g",
                "moe_mmv_g",
            ]
            .iter()
            .map(|k| format!("{k}_{t}"))
            .collect();
            if int8_mma(t) {
                v.extend(
                    [
                        "imm",
                        "imv",
                        "imv2",
                        "mmvqc",
                        "mmvqc1",
                        "mmvqc_glu",
                        "mmvqc1_glu",
                        "mmvqcp",
                        "mmvqcp1",
                        "mmvqcp_glu",
                        "mmvqcp1_glu",
                    ]
                    .iter()
                    .map(|k| format!("{k}_{t}")),
                );
            }
            if int8_activations(t).is_some() {
                v.extend(
                    [
                        "moeq_glu",
                        "moeq_mmv",
                        "mmvq",
                        "mmvq1",
                        "mmvq_glu",
                        "mmvq1_glu",
                        "mmvqp",
                        "mmvqp1",
                        "mmvqp_glu",
                        "mmvqp1_glu",
                    ]
                    .iter()
                    .map(|k| format!("{k}_{t}")),
                );
            }
            v
        }
    }
}

/// The full source NVRTC compiles for a module.
pub fn module_source(module: &str) -> Option<String> {
    let body = match module {
        m if kvq_pair(m).is_some() => {
            let (k, v) = kvq_pair(m)?;
            format!(
                "{KVQ}\nKVQ_KERNELS({k}, {v})\nKVD_KERNELS({k}, {v})\n#line 1 \"flash.cu\"\n{FLASH}\nFLASH_KERNELS({k}, {v})\n",
                k = crate::kvq::kv_type_id(k),
                v = crate::kvq::kv_type_id(v)
            )
        }
        "ops" => OPS.to_string(),
        // The parity mode's embedding kernels use quant.cu's dequantizers.
        "exact" => format!("#line 1 \"quant.cu\"\n{QUANT}\n#line 1 \"exact.cu\"\n{EXACT}"),
        m => {
            let t = m
                .strip_prefix("quant_")
                .filter(|t| QUANT_TYPES.contains(t))?;
            let row_dot = match t {
                "q4_k" | "q6_k" => String::new(),
                "f16" => "ROW_DOT_DENSE(f16, h2f)\n".into(),
                "bf16" => "ROW_DOT_DENSE(bf16, bf2f)\n".into(),
                _ => format!("ROW_DOT_GENERIC({t})\n"),
            };
            let int8 = match int8_activations(t) {
                // The types with int8 tensor-core products also sum in their order (mmvqc*_T,
                // the same bits as imm.cu's imm_T).
                Some(32) if int8_mma(t) => format!(
                    "ROWQ_A32({t}, LOAD_{u})\nQUANT_KERNELS_Q({t})\nROWQ_CANON({t}, LOADC_{u}, {off})\nQUANT_KERNELS_QC({t})\n",
                    u = t.to_uppercase(),
                    off = int8_offset(t)
                ),
                Some(32) => format!(
                    "ROWQ_A32({t}, LOAD_{})\nQUANT_KERNELS_Q({t})\n",
                    t.to_uppercase()
                ),
                Some(_) if int8_mma(t) => format!("QUANT_KERNELS_Q({t})\nQUANT_KERNELS_QC({t})\n"),
                Some(_) => format!("QUANT_KERNELS_Q({t})\n"),
                None => String::new(),
            };
            let (bb, bv) = block_layout(t)?;
            let deqh = match t {
                "q4_0" | "q8_0" | "q4_k" | "q6_k" | "f16" => String::new(),
                _ => format!("DEQH_GENERIC({t})\n"),
            };
            let imm = match (int8_mma(t), bv) {
                (true, 32) => format!(
                    "#line 1 \"imm.cu\"\n{IMM}\nIMM_K({t}, {bb}, {})\n",
                    int8_offset(t)
                ),
                (true, _) => format!("#line 1 \"imm.cu\"\n{IMM}\nIMMK_K({t})\n"),
                _ => String::new(),
            };
            let int8 = if int8.is_empty() {
                int8
            } else {
                format!("#line 1 \"mmvq.cu\"\n{MMVQ}\n{int8}")
            };
            format!("{QUANT}\n{row_dot}QUANT_KERNELS({t})\n{int8}#line 1 \"qmm.cu\"\n{QMM}\n{deqh}QMM_K({t}, {bb}, {bv})\n{imm}")
        }
    };
    Some(format!("{COMMON}\n#line 1 \"{module}.cu\"\n{body}"))
}

fn options(module: &str, arch: u32) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".into(),
        "-default-device".into(),
        "--extra-device-vectorization".into(),
    ];
    if module == "exact" {
        // The parity mode fuses a multiply and an add only where the CPU does (explicit fmaf).
        o.push("--fmad=false".into());
    }
    o
}

/// Compiles one module to a cubin for `sm_<arch>` (e.g. 90). Needs NVRTC, not a GPU.
/// A compile error returns the module name and NVRTC's log.
pub fn compile(module: &str, arch: u32) -> Result<Vec<u8>, String> {
    let src = module_source(module).ok_or_else(|| format!("unknown kernel module {module}"))?;
    compile_source(module, &src, arch)
}

/// Compiles `src` (a whole module) as `module`.
pub fn compile_source(module: &str, src: &str, arch: u32) -> Result<Vec<u8>, String> {
    compile_logged(module, src, arch, false).map(|(c, _)| c)
}

/// ptxas's resources per kernel of `module` (registers, spills, shared memory: its `-v`
/// report, from NVRTC's log), for a look at a kernel's cost without a GPU.
pub fn resource_report(module: &str, arch: u32) -> Result<String, String> {
    let src = module_source(module).ok_or_else(|| format!("unknown kernel module {module}"))?;
    compile_logged(module, &src, arch, true).map(|(_, log)| log)
}

fn compile_logged(
    module: &str,
    src: &str,
    arch: u32,
    verbose: bool,
) -> Result<(Vec<u8>, String), String> {
    crate::libs::nvrtc()?;
    let csrc = CString::new(src.to_string()).map_err(|e| e.to_string())?;
    let name = CString::new(format!("{module}.cu")).unwrap();
    let prog = nr::create_program(&csrc, Some(&name)).map_err(|e| format!("nvrtc: {e:?}"))?;
    // SAFETY: prog is a live program until destroy_program below.
    unsafe {
        let mut opts = options(module, arch);
        if verbose {
            opts.push("--ptxas-options=-v".into());
        }
        let res = nr::compile_program(prog, &opts);
        if res.is_err() {
            let log = nr::get_program_log(prog)
                .map(|l| c_log(&l))
                .unwrap_or_default();
            let _ = nr::destroy_program(prog);
            return Err(format!(
                "kernel module {module} failed to compile for sm_{arch}:\n{log}"
            ));
        }
        let mut size = 0usize;
        let r = ns::nvrtcGetCUBINSize(prog, &mut size);
        if r != ns::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            let _ = nr::destroy_program(prog);
            return Err(format!(
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
        Ok((cubin, log))
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

/// Cache key: module, hash of (source, options, NVRTC version), architecture.
pub fn cache_file(module: &str, arch: u32) -> Result<PathBuf, String> {
    let (a, b) = nvrtc_version()?;
    let mut h = Sha256::new();
    h.update(module_source(module).unwrap_or_default().as_bytes());
    for o in options(module, arch) {
        h.update(o.as_bytes());
    }
    h.update(format!("nvrtc {a}.{b}").as_bytes());
    let hex = quiver_hub::hex(&h.finalize()[..8]);
    Ok(quiver_hub::cache_dir()
        .join("kernels")
        .join(format!("{module}-{hex}-sm{arch}.cubin")))
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
        let cubin = match std::fs::read(&path) {
            Ok(b) if !b.is_empty() => {
                self.from_cache += 1;
                b
            }
            _ => {
                let b = compile(module, self.arch)?;
                self.compiled += 1;
                if let Some(dir) = path.parent() {
                    let _ = std::fs::create_dir_all(dir);
                    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                    if std::fs::write(&tmp, &b).is_ok() {
                        let _ = std::fs::rename(&tmp, &path);
                    }
                }
                b
            }
        };
        // SAFETY: a cubin image for this device's architecture; the driver validates it.
        let m = unsafe { dr::module::load_data(cubin.as_ptr() as *const _) }
            .map_err(|e| format!("loading kernel module {module}: {e:?}"))?;
        self.modules.insert(module.to_string(), m);
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
            let cname = CString::new(name).unwrap();
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
mod tests {
    use super::*;

    /// Kernels run with programmatic dependent launch, which is only safe when each one waits
    /// for its predecessor before touching memory: every kernel's body must open with
    /// `pdl_begin();`.
    #[test]
    fn every_kernel_begins_by_waiting_for_the_previous_one() {
        let mut n = 0;
        for (file, src) in [
            ("quant.cu", QUANT),
            ("mmvq.cu", MMVQ),
            ("qmm.cu", QMM),
            ("imm.cu", IMM),
            ("kvq.cu", KVQ),
            ("ops.cu", OPS),
            ("flash.cu", FLASH),
            ("exact.cu", EXACT),
        ] {
            for (at, _) in src.match_indices("__global__") {
                let body = at + src[at..].find('{').expect("a kernel body");
                // (Inside a macro the body continues past line-ending backslashes.)
                let first =
                    src[body + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                // The matrix-vector kernels may prefetch their weight rows first (quant.cu
                // MMV_BEGIN, common.cuh `pdl_begin_prefetch`: weights are never written, so
                // that read may precede the wait).
                assert!(
                    ["pdl_begin();", "MMV_BEGIN(PF)", "GLU_BEGIN(PF)"]
                        .iter()
                        .any(|p| first.starts_with(p)),
                    "{file}: the kernel at byte {at} does not begin with pdl_begin()"
                );
                n += 1;
            }
        }
        assert!(n >= 20, "found only {n} kernels");
    }
}
