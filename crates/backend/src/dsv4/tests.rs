//! Unit tests of the shapes' checks.

use super::*;

/// Groups of one shape with room for them pass; another shape, too short a buffer or no
/// group is refused.
#[test]
fn grouped_shape_checks_every_group_and_buffer() {
    let need = grouped_scratch_floats(3, 2, 8, 4);
    let ok = |s: &[(usize, usize)], x, out, sc| grouped_shape(s.iter().copied(), 3, x, out, sc);
    assert_eq!(ok(&[(4, 8), (4, 8)], 48, 24, need), Ok((4, 8)));
    assert!(ok(&[(4, 8), (4, 16)], 48, 24, need).is_err());
    assert!(ok(&[(4, 8), (4, 8)], 47, 24, need).is_err());
    assert!(ok(&[(4, 8), (4, 8)], 48, 23, need).is_err());
    assert!(ok(&[(4, 8), (4, 8)], 48, 24, need - 1).is_err());
    assert!(ok(&[], 48, 24, need).is_err());
}
