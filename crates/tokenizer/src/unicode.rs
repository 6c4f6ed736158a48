//! Code point classes as llama.cpp's pre-tokenizers see them, and the GPT-2 byte ↔ unicode map.
//!
//! llama.cpp collapses the Unicode general categories into eight classes (letter, number,
//! mark, punctuation, symbol, separator, control, undefined) and keeps a separate
//! whitespace flag (the Unicode `White_Space` property). The categories come from the
//! `unicode-general-category` crate; `White_Space` is what `char::is_whitespace` tests.

use unicode_general_category::{get_general_category, GeneralCategory as G};

/// The collapsed category of a code point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Letter,
    Number,
    Mark,
    Punctuation,
    Symbol,
    Separator,
    /// Cc, Cf, Co, Cs.
    Control,
    /// Cn: unassigned.
    Undefined,
}

/// Code points first assigned in Unicode 16.0 (DerivedAge). llama.cpp's tables are Unicode
/// 15.1, where these are unassigned; the category crate is at 16.0 (a test pins that).
const NEW_IN_16_0: &[(u32, u32)] = &[
    (0x897, 0x897),
    (0x1b4e, 0x1b4f),
    (0x1b7f, 0x1b7f),
    (0x1c89, 0x1c8a),
    (0x2427, 0x2429),
    (0x31e4, 0x31e5),
    (0xa7cb, 0xa7cd),
    (0xa7da, 0xa7dc),
    (0x105c0, 0x105f3),
    (0x10d40, 0x10d65),
    (0x10d69, 0x10d85),
    (0x10d8e, 0x10d8f),
    (0x10ec2, 0x10ec4),
    (0x10efc, 0x10efc),
    (0x11380, 0x11389),
    (0x1138b, 0x1138b),
    (0x1138e, 0x1138e),
    (0x11390, 0x113b5),
    (0x113b7, 0x113c0),
    (0x113c2, 0x113c2),
    (0x113c5, 0x113c5),
    (0x113c7, 0x113ca),
    (0x113cc, 0x113d5),
    (0x113d7, 0x113d8),
    (0x113e1, 0x113e2),
    (0x116d0, 0x116e3),
    (0x11bc0, 0x11be1),
    (0x11bf0, 0x11bf9),
    (0x11f5a, 0x11f5a),
    (0x13460, 0x143fa),
    (0x16100, 0x16139),
    (0x16d40, 0x16d79),
    (0x18cff, 0x18cff),
    (0x1cc00, 0x1ccf9),
    (0x1cd00, 0x1ceb3),
    (0x1e5d0, 0x1e5fa),
    (0x1e5ff, 0x1e5ff),
    (0x1f8b2, 0x1f8bb),
    (0x1f8c0, 0x1f8c1),
    (0x1fa89, 0x1fa89),
    (0x1fa8f, 0x1fa8f),
    (0x1fabe, 0x1fabe),
    (0x1fac6, 0x1fac6),
    (0x1fadc, 0x1fadc),
    (0x1fadf, 0x1fadf),
    (0x1fae9, 0x1fae9),
    (0x1fbcb, 0x1fbef),
];

fn new_in_16_0(c: char) -> bool {
    let cp = c as u32;
    NEW_IN_16_0
        .binary_search_by(|&(lo, hi)| {
            if hi < cp {
                std::cmp::Ordering::Less
            } else if lo > cp {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

/// The class of `c`, by Unicode 15.1 categories as llama.cpp has them.
pub fn class(c: char) -> Class {
    if c.is_ascii() {
        return ascii_class(c as u8);
    }
    if new_in_16_0(c) {
        return Class::Undefined;
    }
    match get_general_category(c) {
        G::UppercaseLetter
        | G::LowercaseLetter
        | G::TitlecaseLetter
        | G::ModifierLetter
        | G::OtherLetter => Class::Letter,
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => Class::Number,
        G::NonspacingMark | G::SpacingMark | G::EnclosingMark => Class::Mark,
        G::ConnectorPunctuation
        | G::DashPunctuation
        | G::OpenPunctuation
        | G::ClosePunctuation
        | G::InitialPunctuation
        | G::FinalPunctuation
        | G::OtherPunctuation => Class::Punctuation,
        G::MathSymbol | G::CurrencySymbol | G::ModifierSymbol | G::OtherSymbol => Class::Symbol,
        G::SpaceSeparator | G::LineSeparator | G::ParagraphSeparator => Class::Separator,
        G::Control | G::Format | G::PrivateUse | G::Surrogate => Class::Control,
        // Unassigned, and any category a later crate version may add.
        _ => Class::Undefined,
    }
}

fn ascii_class(b: u8) -> Class {
    match b {
        b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
        b'0'..=b'9' => Class::Number,
        b' ' => Class::Separator,
        b'$' | b'+' | b'<' | b'=' | b'>' | b'^' | b'`' | b'|' | b'~' => Class::Symbol,
        0..=0x1f | 0x7f => Class::Control,
        _ => Class::Punctuation,
    }
}

/// Precomputed flags of one code point: the class plus the whitespace bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flags {
    pub class: Class,
    pub ws: bool,
}

impl Flags {
    pub fn of(c: char) -> Flags {
        Flags {
            class: class(c),
            ws: c.is_whitespace(),
        }
    }
    pub fn letter(self) -> bool {
        self.class == Class::Letter
    }
    pub fn number(self) -> bool {
        self.class == Class::Number
    }
    pub fn mark(self) -> bool {
        self.class == Class::Mark
    }
    pub fn punct(self) -> bool {
        self.class == Class::Punctuation
    }
    /// `[^\s\p{L}\p{N}]`
    pub fn other(self) -> bool {
        !(self.ws || self.letter() || self.number())
    }
}

/// GPT-2's reversible map from bytes to printable code points.
pub struct ByteMap {
    to_char: [char; 256],
    from_char: std::collections::HashMap<char, u8>,
}

impl ByteMap {
    pub fn new() -> ByteMap {
        let printable = |b: u32| {
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
        };
        let mut to_char = ['\0'; 256];
        let mut from_char = std::collections::HashMap::with_capacity(256);
        let mut next = 256u32;
        for b in 0..256u32 {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            // Every value here is below 0x144 and so a valid scalar value.
            let ch = char::from_u32(c).unwrap_or('\u{fffd}');
            to_char[b as usize] = ch;
            from_char.insert(ch, b as u8);
        }
        ByteMap { to_char, from_char }
    }

    #[cfg(test)]
    pub fn encode_byte(&self, b: u8) -> char {
        self.to_char[b as usize]
    }

    /// Maps every byte of `s` to its printable code point.
    pub fn encode(&self, s: &str, out: &mut String) {
        for &b in s.as_bytes() {
            out.push(self.to_char[b as usize]);
        }
    }

    /// Decodes a byte-level token text into raw bytes. A code point outside the map (which a
    /// well-formed vocabulary never has) is kept as its own UTF-8 bytes.
    pub fn decode(&self, s: &str, out: &mut Vec<u8>) {
        for c in s.chars() {
            match self.from_char.get(&c) {
                Some(&b) => out.push(b),
                None => {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
    }
}

impl Default for ByteMap {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(class('a'), Class::Letter);
        assert_eq!(class('é'), Class::Letter);
        assert_eq!(class('你'), Class::Letter);
        assert_eq!(class('٣'), Class::Number);
        assert_eq!(class('½'), Class::Number);
        assert_eq!(class('\u{301}'), Class::Mark);
        assert_eq!(class('—'), Class::Punctuation);
        assert_eq!(class('🍕'), Class::Symbol);
        assert_eq!(class('\u{a0}'), Class::Separator);
        assert_eq!(class('\u{200b}'), Class::Control);
        assert_eq!(class('\u{feff}'), Class::Control);
        assert_eq!(class('\u{378}'), Class::Undefined);
        assert!(Flags::of('\u{a0}').ws);
        assert!(!Flags::of('\u{200b}').ws);
        assert!(Flags::of('\u{3000}').ws);
        assert!(Flags::of('\u{85}').ws);
        for b in 0u8..128 {
            let c = b as char;
            let g = get_general_category(c);
            let want = match g {
                G::UppercaseLetter | G::LowercaseLetter => Class::Letter,
                G::DecimalNumber => Class::Number,
                G::SpaceSeparator => Class::Separator,
                G::Control => Class::Control,
                G::MathSymbol | G::CurrencySymbol | G::ModifierSymbol => Class::Symbol,
                _ => Class::Punctuation,
            };
            assert_eq!(class(c), want, "{c:?}");
        }
    }

    #[test]
    fn unicode_versions() {
        // NEW_IN_16_0 turns the crate's Unicode 16.0 back into 15.1: a newer crate needs a
        // new table here.
        assert_eq!(unicode_general_category::UNICODE_VERSION, (16, 0, 0));
        assert_eq!(
            NEW_IN_16_0.iter().map(|&(a, b)| b - a + 1).sum::<u32>(),
            5185
        );
        assert_eq!(class('\u{1c89}'), Class::Undefined);
        assert_eq!(class('\u{13460}'), Class::Undefined);
        assert_eq!(class('\u{1c88}'), Class::Letter);
        // CJK Extension I is Unicode 15.1.
        assert_eq!(class('\u{2ebf0}'), Class::Letter);
        assert_eq!(class('\u{31ef}'), Class::Symbol);
    }

    #[test]
    fn byte_map_round_trip() {
        let m = ByteMap::new();
        assert_eq!(m.encode_byte(b' '), 'Ġ');
        assert_eq!(m.encode_byte(b'\n'), 'Ċ');
        assert_eq!(m.encode_byte(b'A'), 'A');
        let mut s = String::new();
        let all: Vec<u8> = (0..=255).collect();
        for &b in &all {
            s.push(m.encode_byte(b));
        }
        let mut back = Vec::new();
        m.decode(&s, &mut back);
        assert_eq!(back, all);
    }
}
