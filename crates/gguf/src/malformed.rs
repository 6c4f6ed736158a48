//! Hand-made malformed GGUF files, shared by the parser's tests and the CLI's tests.
//! Each case names the defect and a fragment the error message must contain.

use crate::value::ValueType;
use crate::GgmlType;

pub struct Case {
    pub name: &'static str,
    pub bytes: Vec<u8>,
    /// A fragment of the expected error message.
    pub expect: &'static str,
}

/// Builds GGUF images field by field, including fields no valid writer would produce.
#[derive(Default, Clone)]
pub struct Builder {
    pub buf: Vec<u8>,
}

impl Builder {
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut b = Builder::default();
        b.raw(b"GGUF").u32(version).u64(n_tensors).u64(n_kv);
        b
    }
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    /// A key with a u32 value.
    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(ValueType::U32 as u32).u32(v)
    }
    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.str(key).u32(ValueType::String as u32).str(v)
    }
    /// A tensor info with `ne` dimensions.
    pub fn tensor(&mut self, name: &str, ne: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(ne.len() as u32);
        for &d in ne {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to 32 bytes and appends `n` data bytes.
    pub fn data(&mut self, n: usize) -> &mut Self {
        let pad = self.buf.len().div_ceil(32) * 32;
        self.buf.resize(pad + n, 0x11);
        self
    }
    pub fn done(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }
}

fn b(version: u32, n_tensors: u64, n_kv: u64) -> Builder {
    Builder::header(version, n_tensors, n_kv)
}

const F32: u32 = 0;

pub fn cases() -> Vec<Case> {
    let q40 = GgmlType::Q4_0.id();
    let mut v = vec![
        Case {
            name: "empty file",
            bytes: vec![],
            expect: "truncated",
        },
        Case {
            name: "three bytes",
            bytes: b"GGU".to_vec(),
            expect: "truncated",
        },
        Case {
            name: "bad magic",
            bytes: b"GGML\x03\0\0\0".to_vec(),
            expect: "not a GGUF file",
        },
        Case {
            name: "version 1",
            bytes: b(1, 0, 0).done(),
            expect: "version 1",
        },
        Case {
            name: "version 4",
            bytes: b(4, 0, 0).done(),
            expect: "version 4",
        },
        Case {
            name: "big-endian",
            bytes: b(3u32.swap_bytes(), 0, 0).done(),
            expect: "big-endian",
        },
        Case {
            name: "truncated counts",
            bytes: b(3, 0, 0).done()[..12].to_vec(),
            expect: "truncated",
        },
        Case {
            name: "absurd metadata count",
            bytes: b(3, 0, u64::MAX).done(),
            expect: "metadata count",
        },
        Case {
            name: "absurd tensor count",
            bytes: b(3, u64::MAX, 0).done(),
            expect: "tensor count",
        },
        Case {
            name: "absurd key length",
            bytes: b(3, 0, 1).u64(u64::MAX).raw(b"abcdefghijklmnop").done(),
            expect: "truncated",
        },
        Case {
            name: "key not UTF-8",
            bytes: b(3, 0, 1).u64(2).raw(&[0xff, 0xfe]).u32(4).u32(1).done(),
            expect: "UTF-8",
        },
        Case {
            name: "unknown value type",
            bytes: b(3, 0, 1).str("k").u32(13).u32(0).done(),
            expect: "unknown value type id 13",
        },
        Case {
            name: "value type u32::MAX",
            bytes: b(3, 0, 1).str("k").u32(u32::MAX).done(),
            expect: "unknown value type id 4294967295",
        },
        Case {
            name: "absurd array count",
            bytes: b(3, 0, 1).str("k").u32(9).u32(4).u64(1 << 62).done(),
            expect: "count",
        },
        Case {
            name: "array of unknown type",
            bytes: b(3, 0, 1).str("k").u32(9).u32(77).u64(1).done(),
            expect: "unknown value type id 77",
        },
        Case {
            name: "absurd string length",
            bytes: b(3, 0, 1).str("k").u32(8).u64(1 << 40).raw(b"xyz").done(),
            expect: "truncated",
        },
        Case {
            name: "bool byte 2",
            bytes: b(3, 0, 1).str("k").u32(7).raw(&[2]).done(),
            expect: "bool byte 2",
        },
        Case {
            name: "duplicate key",
            bytes: b(3, 0, 2).kv_u32("a", 1).kv_u32("a", 2).done(),
            expect: "duplicate metadata key",
        },
        Case {
            name: "alignment 0",
            bytes: b(3, 0, 1).kv_u32("general.alignment", 0).done(),
            expect: "alignment = 0",
        },
        Case {
            name: "alignment 3",
            bytes: b(3, 0, 1).kv_u32("general.alignment", 3).done(),
            expect: "alignment = 3",
        },
        Case {
            name: "alignment as string",
            bytes: b(3, 0, 1).kv_str("general.alignment", "32").done(),
            expect: "general.alignment",
        },
        Case {
            name: "alignment 2^40",
            bytes: b(3, 0, 1)
                .str("general.alignment")
                .u32(10)
                .u64(1 << 40)
                .done(),
            expect: "alignment",
        },
        Case {
            name: "five dimensions",
            bytes: b(3, 1, 0)
                .tensor("t", &[1, 1, 1, 1, 1], F32, 0)
                .data(4)
                .done(),
            expect: "5 dimensions",
        },
        Case {
            name: "removed tensor type 4",
            bytes: b(3, 1, 0).tensor("t", &[32], 4, 0).data(32).done(),
            expect: "unknown tensor type id 4",
        },
        Case {
            name: "tensor type 1000",
            bytes: b(3, 1, 0).tensor("t", &[32], 1000, 0).data(32).done(),
            expect: "unknown tensor type id 1000",
        },
        Case {
            name: "element count overflow",
            bytes: b(3, 1, 0)
                .tensor("t", &[1 << 32, 1 << 32], F32, 0)
                .data(4)
                .done(),
            expect: "overflows",
        },
        Case {
            name: "dimension beyond i64",
            bytes: b(3, 1, 0).tensor("t", &[u64::MAX], F32, 0).data(4).done(),
            expect: "exceeds i64",
        },
        Case {
            name: "row not a whole number of blocks",
            bytes: b(3, 1, 0).tensor("t", &[33, 2], q40, 0).data(64).done(),
            expect: "not a multiple",
        },
        Case {
            name: "misaligned offset",
            bytes: b(3, 1, 0).tensor("t", &[4], F32, 4).data(64).done(),
            expect: "alignment",
        },
        Case {
            name: "data past the end",
            bytes: b(3, 1, 0).tensor("t", &[64], F32, 0).data(100).done(),
            expect: "outside the data section",
        },
        Case {
            name: "offset near u64::MAX",
            bytes: b(3, 1, 0)
                .tensor("t", &[64], F32, u64::MAX - 31)
                .data(256)
                .done(),
            expect: "outside the data section",
        },
        Case {
            name: "overlapping tensors",
            bytes: b(3, 2, 0)
                .tensor("a", &[16], F32, 0)
                .tensor("b", &[16], F32, 32)
                .data(128)
                .done(),
            expect: "overlap",
        },
        Case {
            name: "duplicate tensor name",
            bytes: b(3, 2, 0)
                .tensor("a", &[8], F32, 0)
                .tensor("a", &[8], F32, 32)
                .data(64)
                .done(),
            expect: "duplicate tensor",
        },
        Case {
            name: "absurd tensor name length",
            bytes: b(3, 1, 0).u64(u64::MAX / 2).raw(&[b't'; 40]).done(),
            expect: "truncated",
        },
        Case {
            name: "truncated inside tensor info",
            bytes: b(3, 1, 0).str("t").u32(2).u64(4).raw(&[0; 5]).done(),
            expect: "truncated",
        },
        Case {
            name: "tensor name not UTF-8",
            bytes: b(3, 1, 0)
                .u64(1)
                .raw(&[0xc3])
                .u32(1)
                .u64(4)
                .u32(F32)
                .u64(0)
                .data(16)
                .done(),
            expect: "UTF-8",
        },
    ];
    // Arrays nested one level deeper than allowed.
    let mut deep = b(3, 0, 1);
    deep.str("k").u32(ValueType::Array as u32);
    for _ in 0..crate::MAX_ARRAY_DEPTH {
        deep.u32(ValueType::Array as u32).u64(1);
    }
    deep.u32(ValueType::U8 as u32).u64(0);
    v.push(Case {
        name: "arrays nested too deep",
        bytes: deep.done(),
        expect: "nested deeper",
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgufFile;

    #[test]
    fn every_malformed_case_gives_its_error() {
        let cases = cases();
        assert!(cases.len() >= 30, "only {} cases", cases.len());
        for c in cases {
            match GgufFile::from_bytes(c.bytes) {
                Ok(_) => panic!("{}: parsed without error", c.name),
                Err(e) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains(c.expect),
                        "{}: error {msg:?} lacks {:?}",
                        c.name,
                        c.expect
                    );
                    assert!(
                        !msg.contains('\n'),
                        "{}: error is not one line: {msg:?}",
                        c.name
                    );
                }
            }
        }
    }

    #[test]
    fn the_builder_makes_valid_files_when_asked() {
        let bytes = b(3, 2, 1)
            .kv_u32("x", 7)
            .tensor("a", &[8], F32, 0)
            .tensor("b", &[32, 2], q40(), 32)
            .data(32 + 36)
            .done();
        let f = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(f.get_u32("x").unwrap(), Some(7));
        assert_eq!(f.tensor("b").unwrap().shape, vec![2, 32]);
        assert_eq!(f.tensor_data(f.tensor("b").unwrap()).len(), 36);
    }

    fn q40() -> u32 {
        GgmlType::Q4_0.id()
    }
}
