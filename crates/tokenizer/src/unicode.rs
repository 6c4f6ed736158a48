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

/// The class of `c`.
pub fn class(c: char) -> Class {
    if c.is_ascii() {
        return ascii_class(c as u8);
    }
    match get_general_category(c) {
        G::UppercaseLetter | G::LowercaseLetter | G::TitlecaseLetter | G::ModifierLetter | G::OtherLetter => {
            Class::Letter
        }
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
        Flags { class: class(c), ws: c.is_whitespace() }
    }
    pub fn letter(self) -> bool {
        self.class == Class::Letter
    }
    pub fn number(self) -> bool {
        self.class == Class::Number
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
        let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
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
