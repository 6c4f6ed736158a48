//! GBNF (llama.cpp's grammar format: `root ::= ...`) rewritten as the Lark dialect llguidance
//! compiles, so that llama-server's `grammar` field works as it does there.
//!
//! Rules `name ::= alternatives`; literals `"..."` (escapes `\n \r \t \\ \" \[ \] \xHH \uHHHH
//! \UHHHHHHHH`), character classes `[a-z]` / `[^...]`, `.` (any character), groups `( )`,
//! repetitions `* + ? {m} {m,} {m,n} {,n}`, comments `#` to the end of the line. A rule ends at
//! the end of its line unless a group is open; alternatives may continue on the next line
//! after a `|`. `root` is the start rule.

/// Most groups open at once: the parser recurses once per group, and Lark refuses grammars
/// nested deeper than this anyway.
const MAX_GROUP_DEPTH: usize = 200;

/// The Lark text of a GBNF grammar, or why it is not one.
pub fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let mut p = Parser {
        s: src.chars().collect(),
        pos: 0,
        line: 1,
        depth: 0,
    };
    let mut rules: Vec<(String, String)> = Vec::new();
    loop {
        p.space(true);
        if p.pos >= p.s.len() {
            break;
        }
        let name = p.name().ok_or_else(|| p.err("expected a rule name"))?;
        p.space(false);
        if !p.eat_str("::=") {
            return Err(p.err(&format!("expected `::=` after `{name}`")));
        }
        p.space(true);
        let body = p.alternates(false)?;
        if rules.iter().any(|(n, _)| *n == name) {
            return Err(p.err(&format!("rule `{name}` is defined twice")));
        }
        rules.push((name, body));
        p.space(false);
        if p.pos < p.s.len() && p.s[p.pos] != '\n' {
            return Err(p.err(&format!("unexpected `{}`", p.s[p.pos])));
        }
    }
    if !rules.iter().any(|(n, _)| n == "root") {
        return Err("the grammar has no `root` rule".into());
    }
    let mut out = format!("start: {}\n", rule_name("root"));
    for (n, b) in &rules {
        out += &format!("{}: {b}\n", rule_name(n));
    }
    Ok(out)
}

/// A GBNF rule name as a Lark rule name (lowercase letters, digits, underscores): `r_` then
/// the name with `-` as `_h` and capitals as `_` and the small letter, `_` as `__`.
fn rule_name(n: &str) -> String {
    let mut s = String::from("r_");
    for c in n.chars() {
        match c {
            '-' => s += "_h",
            '_' => s += "__",
            c if c.is_ascii_uppercase() => {
                s.push('_');
                s.push(c.to_ascii_lowercase());
            }
            c => s.push(c),
        }
    }
    s
}

/// A character inside a regex class (`\x{..}` for anything but letters and digits).
fn class_char(c: char) -> String {
    if c.is_ascii_alphanumeric() {
        c.to_string()
    } else {
        format!("\\x{{{:X}}}", c as u32)
    }
}

struct Parser {
    s: Vec<char>,
    pos: usize,
    line: usize,
    /// Groups open.
    depth: usize,
}

impl Parser {
    fn err(&self, what: &str) -> String {
        format!("GBNF grammar, line {}: {what}", self.line)
    }

    fn peek(&self) -> Option<char> {
        self.s.get(self.pos).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn eat_str(&mut self, t: &str) -> bool {
        let t: Vec<char> = t.chars().collect();
        if self.s[self.pos..].starts_with(&t) {
            self.pos += t.len();
            true
        } else {
            false
        }
    }

    /// Skips spaces, tabs and comments; newlines too when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' | '\r' => self.pos += 1,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.pos += 1;
                    }
                }
                '\n' if newlines => {
                    self.pos += 1;
                    self.line += 1;
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            self.pos += 1;
        }
        (self.pos > start).then(|| self.s[start..self.pos].iter().collect())
    }

    fn alternates(&mut self, nested: bool) -> Result<String, String> {
        let mut alts = vec![self.sequence(nested)?];
        while self.eat('|') {
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts.join(" | "))
    }

    fn sequence(&mut self, nested: bool) -> Result<String, String> {
        let mut items = Vec::new();
        loop {
            self.space(nested);
            match self.peek() {
                None | Some('|') | Some(')') | Some('\n') => break,
                _ => {}
            }
            let mut it = self.atom()?;
            loop {
                match self.peek() {
                    Some(c @ ('*' | '+' | '?')) => {
                        self.pos += 1;
                        it = format!("{it}{c}");
                    }
                    Some('{') => {
                        self.pos += 1;
                        it = format!("{it}{}", self.braces()?);
                    }
                    _ => break,
                }
            }
            items.push(it);
        }
        Ok(if items.is_empty() {
            "\"\"".into()
        } else {
            items.join(" ")
        })
    }

    /// `{m}`, `{m,}`, `{m,n}`, `{,n}` (the `{` taken) as Lark's repetition.
    fn braces(&mut self) -> Result<String, String> {
        let num = |p: &mut Parser| {
            p.space(false);
            let start = p.pos;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.pos += 1;
            }
            let s: String = p.s[start..p.pos].iter().collect();
            p.space(false);
            (!s.is_empty()).then(|| s.parse::<u32>().ok()).flatten()
        };
        let m = num(self);
        let r = if self.eat(',') {
            let n = num(self);
            match (m, n) {
                (Some(m), Some(n)) if m <= n => format!("{{{m},{n}}}"),
                (None, Some(n)) => format!("{{0,{n}}}"),
                (Some(m), None) => format!("{{{m},}}"),
                _ => return Err(self.err("bad repetition bounds")),
            }
        } else {
            format!("{{{}}}", m.ok_or_else(|| self.err("bad repetition count"))?)
        };
        if !self.eat('}') {
            return Err(self.err("expected `}`"));
        }
        Ok(r)
    }

    fn atom(&mut self) -> Result<String, String> {
        match self.peek() {
            Some('"') => {
                self.pos += 1;
                let mut lit = String::new();
                loop {
                    match self.peek() {
                        None | Some('\n') => return Err(self.err("unterminated string")),
                        Some('"') => {
                            self.pos += 1;
                            break;
                        }
                        Some('\\') => lit.push(self.escape()?),
                        Some(c) => {
                            self.pos += 1;
                            lit.push(c);
                        }
                    }
                }
                if lit.is_empty() {
                    return Ok("\"\"".into());
                }
                Ok(serde_json::to_string(&lit).expect("a string serializes"))
            }
            Some('[') => {
                self.pos += 1;
                let mut re = String::from("/[");
                if self.eat('^') {
                    re.push('^');
                }
                let mut any = false;
                loop {
                    let c = match self.peek() {
                        None | Some('\n') => return Err(self.err("unterminated character class")),
                        Some(']') if any => {
                            self.pos += 1;
                            break;
                        }
                        Some('\\') => self.escape()?,
                        Some(c) => {
                            self.pos += 1;
                            c
                        }
                    };
                    any = true;
                    re += &class_char(c);
                    if self.peek() == Some('-')
                        && self.s.get(self.pos + 1).is_some_and(|&n| n != ']')
                    {
                        self.pos += 1;
                        let hi = match self.peek() {
                            Some('\\') => self.escape()?,
                            Some(h) => {
                                self.pos += 1;
                                h
                            }
                            None => return Err(self.err("unterminated character class")),
                        };
                        if hi < c {
                            return Err(self.err("a character range runs backwards"));
                        }
                        re.push('-');
                        re += &class_char(hi);
                    }
                }
                re += "]/";
                Ok(re)
            }
            Some('.') => {
                self.pos += 1;
                Ok("/(?s:.)/".into())
            }
            Some('(') => {
                if self.depth == MAX_GROUP_DEPTH {
                    return Err(
                        self.err(&format!("groups nested more than {MAX_GROUP_DEPTH} deep"))
                    );
                }
                self.pos += 1;
                self.space(true);
                self.depth += 1;
                let inner = self.alternates(true);
                self.depth -= 1;
                let inner = inner?;
                self.space(true);
                if !self.eat(')') {
                    return Err(self.err("expected `)`"));
                }
                Ok(format!("({inner})"))
            }
            Some(c) if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let n = self.name().expect("a name starts here");
                Ok(rule_name(&n))
            }
            Some(c) => Err(self.err(&format!("unexpected `{c}`"))),
            None => Err(self.err("unexpected end")),
        }
    }

    /// One escape sequence (the `\` at `pos`) as its character.
    fn escape(&mut self) -> Result<char, String> {
        self.pos += 1;
        let c = self.peek().ok_or_else(|| self.err("unterminated escape"))?;
        self.pos += 1;
        let hex = |p: &mut Parser, n: usize| -> Result<char, String> {
            let h: String = p.s.get(p.pos..p.pos + n).unwrap_or(&[]).iter().collect();
            p.pos += n;
            u32::from_str_radix(&h, 16)
                .ok()
                .filter(|_| h.len() == n)
                .and_then(char::from_u32)
                .ok_or_else(|| p.err(&format!("bad escape `{h}`")))
        };
        Ok(match c {
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'x' => hex(self, 2)?,
            'u' => hex(self, 4)?,
            'U' => hex(self, 8)?,
            '\\' | '"' | '[' | ']' | '-' | '^' | '/' | '.' => c,
            c => return Err(self.err(&format!("unknown escape `\\{c}`"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_literals_classes_groups_and_repeats_become_lark() {
        let g = "root ::= greeting (\" \" name)? [!.]{1,3} # a comment\n\
                 greeting ::= \"hi\" | \"hello\"\n\
                 name ::= [A-Z] [a-z\\-]* | my-Name_x\n\
                 my-Name_x ::= \"\\\"q\\\"\\n\"\n";
        let l = gbnf_to_lark(g).unwrap();
        assert_eq!(
            l,
            "start: r_root\n\
             r_root: r_greeting (\" \" r_name)? /[\\x{21}\\x{2E}]/{1,3}\n\
             r_greeting: \"hi\" | \"hello\"\n\
             r_name: /[A-Z]/ /[a-z\\x{2D}]/* | r_my_h_name__x\n\
             r_my_h_name__x: \"\\\"q\\\"\\n\"\n"
        );
    }

    #[test]
    fn groups_span_lines_and_alternatives_continue_after_a_bar() {
        let g = "root ::=\n  \"{\" (\n    \"a\" |\n    \"b\"\n  )* \"}\" x{2} y{,4} z{3,}\nx ::= \"x\"\ny ::= \"y\"\nz ::= \"z\" | \n  \"w\"\n";
        let l = gbnf_to_lark(g).unwrap();
        assert!(
            l.contains("r_root: \"{\" (\"a\" | \"b\")* \"}\" r_x{2} r_y{0,4} r_z{3,}\n"),
            "{l}"
        );
        assert!(l.contains("r_z: \"z\" | \"w\"\n"), "{l}");
    }

    #[test]
    fn what_is_not_gbnf_is_an_error_with_its_line() {
        for (g, what) in [
            (
                "root ::= \"a\"\nroot ::= \"b\"",
                "line 2: rule `root` is defined twice",
            ),
            ("start ::= \"a\"", "no `root` rule"),
            ("root ::= \"a", "line 1: unterminated string"),
            ("root ::= [z-a]", "runs backwards"),
            ("root ::= \"a\" )", "unexpected `)`"),
            ("root = \"a\"", "expected `::=`"),
            ("root ::= (\"a\"", "expected `)`"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= x{3,1}", "bad repetition bounds"),
        ] {
            let e = gbnf_to_lark(g).unwrap_err();
            assert!(e.contains(what), "{g:?}: {e}");
        }
    }

    /// Nesting is bounded before it can exhaust a thread's stack (5,000 groups overflowed
    /// the request thread's stack and aborted the server).
    #[test]
    fn groups_nested_past_the_bound_are_an_error() {
        let nested = |n: usize| format!("root ::= {}\"a\"{}", "(".repeat(n), ")".repeat(n));
        assert!(gbnf_to_lark(&nested(MAX_GROUP_DEPTH)).is_ok());
        for n in [MAX_GROUP_DEPTH + 1, 5_000, 1_000_000] {
            let e = std::thread::Builder::new()
                .stack_size(1 << 20)
                .spawn(move || gbnf_to_lark(&nested(n)))
                .unwrap()
                .join()
                .expect("no stack overflow")
                .unwrap_err();
            assert!(e.contains("nested more than 200 deep"), "{n}: {e}");
        }
    }
}
