//! The registry's own tests: every kernel file's kernels listed, each waiting for its
//! predecessor, module sources and names.

use super::*;

const FILES: [(&str, &str); 14] = [
    ("quant.cu", QUANT),
    ("delta.cu", DELTA),
    ("dsv4.cu", DSV4),
    ("wmm.cu", WMM),
    ("mmv.cu", MMV),
    ("mmvq.cu", MMVQ),
    ("qmm.cu", QMM),
    ("imm.cu", IMM),
    ("immw.cu", IMMW),
    ("kvq.cu", KVQ),
    ("ops.cu", OPS),
    ("flash.cu", FLASH),
    ("fwg.cu", FWG),
    ("exact.cu", EXACT),
];

/// A kernel's name from its header (`__global__` to the body): the identifier before the
/// parameters, past any `__launch_bounds__(…)`.
fn kernel_name(header: &str) -> String {
    let mut h = header.to_string();
    if let Some(i) = h.find("__launch_bounds__(") {
        let mut depth = 0;
        for (j, c) in h[i..].char_indices() {
            depth += match c {
                '(' => 1,
                ')' => -1,
                _ => 0,
            };
            if c == ')' && depth == 0 {
                h.replace_range(i..i + j + 1, "");
                break;
            }
        }
    }
    let before = &h[..h.find('(').expect("parameters")];
    let name = before
        .trim_end()
        .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'));
    name.into_iter().next().unwrap_or_default().to_string()
}

/// Each kernel of the sources: (file, byte offset of `__global__`, its name).
fn kernels_in_sources() -> Vec<(&'static str, usize, String)> {
    let mut v = Vec::new();
    for (file, src) in FILES {
        for (at, _) in src.match_indices("__global__") {
            let body = at + src[at..].find('{').expect("a kernel body");
            v.push((file, at, kernel_name(&src[at..body])));
        }
    }
    v
}

/// Kernels run with programmatic dependent launch, which is only safe when each one waits
/// for its predecessor before touching memory: every kernel's body must open with
/// `pdl_begin();`.
#[test]
fn every_kernel_begins_by_waiting_for_the_previous_one() {
    let mut n = 0;
    for (file, src) in FILES {
        for (at, _) in src.match_indices("__global__") {
            let body = at + src[at..].find('{').expect("a kernel body");
            let first = src[body + 1..].trim_start();
            // The matrix-vector kernels may prefetch their weight rows first (mmv.cu
            // MMV_BEGIN, common.cuh `pdl_begin_prefetch`: weights are never written, so
            // that read may precede the wait), the norm may load its weights first (ops.cu
            // `norm_begin`), and imm on wgmma (imm.cu `immw_impl`) sends its first stages'
            // weight copies before its pdl_begin; none touches anything else before the wait.
            assert!(
                [
                    "pdl_begin();",
                    "MMV_BEGIN(PF)",
                    "GLU_BEGIN(PF)",
                    "const NormW g = norm_begin(",
                    "immw_impl<"
                ]
                .iter()
                .any(|p| first.starts_with(p)),
                "{file}: the kernel at byte {at} does not begin with pdl_begin()"
            );
            n += 1;
        }
    }
    assert!(n >= 20, "found only {n} kernels");
}

/// A names file as `ensure` writes it reads back to the module's launch → lowered names,
/// and one that lacks a kernel of the list is not taken (the module is compiled again).
#[test]
fn a_names_file_must_name_every_kernel_of_the_list() {
    let list = kernels("quant_q4_k");
    assert!(list
        .iter()
        .any(|(n, e)| n == "mmvqcp1_glu_q4_k" && e == "mmvq_glu<Q4_K, true, 1, true>"));
    let text: String = list.iter().map(|(n, _)| format!("{n} _Z{n}\n")).collect();
    let names = parse_names("quant_q4_k", &text).expect("every kernel named");
    assert_eq!(names.len(), list.len());
    assert_eq!(names["embed_q4_k"], "_Zembed_q4_k");
    let partial: String = text.lines().skip(1).map(|l| format!("{l}\n")).collect();
    assert!(parse_names("quant_q4_k", &partial).is_none());
}

/// Kernels are functions or templates, never the body of a `#define`, and each is
/// instantiated by some module's list.
#[test]
fn kernels_are_templates_instantiated_from_the_lists() {
    let mut exprs = String::new();
    for m in module_names() {
        for (_, e) in kernels(&m) {
            exprs += &e;
            exprs.push('\n');
        }
    }
    let found = kernels_in_sources();
    assert!(found.len() >= 40, "found only {} kernels", found.len());
    for (file, at, name) in found {
        let src = FILES.iter().find(|f| f.0 == file).unwrap().1;
        let line = src[at..].lines().next().unwrap_or_default();
        assert!(
            !line.trim_end().ends_with('\\'),
            "{file}: kernel {name} is inside a macro"
        );
        assert!(
            exprs
                .lines()
                .any(|e| e == name || e.starts_with(&format!("{name}<"))),
            "{file}: kernel {name} is in no module's list"
        );
    }
}
