// Lloyd–Max levels of N(0, 1), from `turboquant::lloyd_max` (see there); regenerate with
// `cargo test -p quiver-backend --release turboquant -- --ignored --nocapture`.
pub const TQ4_LEVELS: [f32; 16] = [
    -2.7325895e0,
    -2.0690172e0,
    -1.6180464e0,
    -1.2562312e0,
    -9.4234043e-1,
    -6.5675914e-1,
    -3.880483e-1,
    -1.2839504e-1,
    1.2839504e-1,
    3.880483e-1,
    6.5675914e-1,
    9.4234043e-1,
    1.2562312e0,
    1.6180464e0,
    2.0690172e0,
    2.7325895e0,
];
