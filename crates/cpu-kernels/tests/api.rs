//! Argument checking, get_rows, scratch reuse.

use quiver_cpu_kernels::{get_rows, matmul, GgmlType, KernelError, Scratch, ThreadPool};

#[test]
fn bad_lengths_and_types_are_errors_not_panics() {
    let pool = ThreadPool::new(2).unwrap();
    let mut s = Scratch::new();
    let (rows, cols, n) = (4, 64, 2);
    let w = vec![0u8; rows * GgmlType::Q8_0.row_bytes(cols as u64).unwrap() as usize];
    let x = vec![1f32; n * cols];
    let mut out = vec![0f32; n * rows];
    let ok = matmul(
        &pool,
        GgmlType::Q8_0,
        &w,
        rows,
        cols,
        &x,
        n,
        &mut out,
        &mut s,
    );
    assert_eq!(ok, Ok(()));
    let e = matmul(
        &pool,
        GgmlType::Q8_0,
        &w[1..],
        rows,
        cols,
        &x,
        n,
        &mut out,
        &mut s,
    )
    .unwrap_err();
    assert!(matches!(e, KernelError::Length { what: "w", .. }), "{e}");
    assert!(e.to_string().contains("matmul Q8_0"), "{e}");
    let e = matmul(
        &pool,
        GgmlType::Q8_0,
        &w,
        rows,
        cols,
        &x[1..],
        n,
        &mut out,
        &mut s,
    )
    .unwrap_err();
    assert!(matches!(e, KernelError::Length { what: "x", .. }), "{e}");
    let e = matmul(
        &pool,
        GgmlType::Q8_0,
        &w,
        rows,
        cols,
        &x,
        n,
        &mut out[1..],
        &mut s,
    )
    .unwrap_err();
    assert!(matches!(e, KernelError::Length { what: "out", .. }), "{e}");
    let e = matmul(
        &pool,
        GgmlType::Q4_K,
        &w,
        rows,
        cols,
        &x,
        n,
        &mut out,
        &mut s,
    )
    .unwrap_err();
    assert!(matches!(e, KernelError::BlockMultiple { .. }), "{e}");
    let e = matmul(
        &pool,
        GgmlType::IQ2_XXS,
        &w,
        rows,
        cols,
        &x,
        n,
        &mut out,
        &mut s,
    )
    .unwrap_err();
    assert!(matches!(e, KernelError::Unsupported { .. }), "{e}");
    let e = matmul(
        &pool,
        GgmlType::Q8_0,
        &w,
        usize::MAX,
        cols,
        &x,
        n,
        &mut out,
        &mut s,
    )
    .unwrap_err();
    assert!(matches!(e, KernelError::Length { .. }), "{e}");
}

#[test]
fn get_rows_gathers_dequantized_rows() {
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::F16,
        GgmlType::Q6_K,
    ] {
        let (rows, cols) = (7, 512);
        let f: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut w = Vec::new();
        quiver_quant::quantize(ty, &f, &mut w).unwrap();
        let mut all = vec![0f32; rows * cols];
        quiver_quant::dequantize(ty, &w, &mut all).unwrap();
        let ids = [6u32, 0, 3, 3];
        let mut out = vec![f32::NAN; ids.len() * cols];
        get_rows(ty, &w, cols, &ids, &mut out).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(
                &out[i * cols..(i + 1) * cols],
                &all[id as usize * cols..(id as usize + 1) * cols],
                "{ty}"
            );
        }
        let e = get_rows(ty, &w, cols, &[7], &mut out[..cols]).unwrap_err();
        assert!(
            matches!(e, KernelError::RowOutOfRange { id: 7, rows: 7, .. }),
            "{e}"
        );
        let e = get_rows(ty, &w, cols, &[1], &mut out).unwrap_err();
        assert!(matches!(e, KernelError::Length { what: "out", .. }), "{e}");
    }
}

#[test]
fn scratch_stops_growing() {
    let pool = ThreadPool::new(2).unwrap();
    let mut s = Scratch::new();
    let (rows, cols) = (8, 512);
    let w = vec![0x11u8; rows * GgmlType::Q4_K.row_bytes(cols as u64).unwrap() as usize];
    for n in [1, 64, 1, 64] {
        let x = vec![0.5f32; n * cols];
        let mut out = vec![0f32; n * rows];
        matmul(
            &pool,
            GgmlType::Q4_K,
            &w,
            rows,
            cols,
            &x,
            n,
            &mut out,
            &mut s,
        )
        .unwrap();
    }
    let cap = s.capacity_bytes();
    for n in [1, 2, 64, 33] {
        let x = vec![0.5f32; n * cols];
        let mut out = vec![0f32; n * rows];
        matmul(
            &pool,
            GgmlType::Q4_K,
            &w,
            rows,
            cols,
            &x,
            n,
            &mut out,
            &mut s,
        )
        .unwrap();
    }
    assert_eq!(s.capacity_bytes(), cap);
}
