//! Parsing of one FQN glob pattern into a small AST.
//!
//! The parser only checks the local syntax (balanced brackets, ranges, escapes); the rules about
//! whole segments (`**`, empty segments) depend on how braces expand and live in `segments.rs`.

use std::fmt;

/// The deepest brace nesting a pattern may use (a documented limit, see README).
pub const MAX_BRACE_DEPTH: usize = 16;

/// A parse failure: what is wrong and where, as a character offset into the pattern text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternSyntaxError {
    pub position: usize,
    pub reason: String,
}

impl PatternSyntaxError {
    pub fn new(position: usize, reason: impl Into<String>) -> Self {
        Self {
            position,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for PatternSyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (at character {})", self.reason, self.position)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClassItem {
    Char(char),
    Range(char, char),
}

/// One element of a glob. Positions are character offsets, kept where a later check may point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// A run of literal characters, escapes resolved (never empty; never two in a row).
    Literal(String),
    /// `*`: any run of non-dot characters.
    Star,
    /// `?`: one non-dot character.
    AnyChar,
    Class {
        negated: bool,
        items: Vec<ClassItem>,
    },
    /// `<lo-hi>`: a canonical decimal numeral in the closed range.
    Range { lo: u64, hi: u64 },
    Alternation {
        position: usize,
        alternatives: Vec<Vec<Node>>,
    },
    /// The segment separator `.`.
    Dot { position: usize },
    /// `**` as written; whether it stands as a whole segment is checked later.
    Globstar { position: usize },
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
}

/// Parses the text of a glob pattern (not `re:`, not the root pattern `""`).
pub fn parse_glob(text: &str) -> Result<Vec<Node>, PatternSyntaxError> {
    let mut parser = Parser {
        chars: text.chars().collect(),
        pos: 0,
    };
    let nodes = parser.sequence(0)?;
    if parser.pos < parser.chars.len() {
        // Only a stray `}` or `,` at depth 0 stops a sequence early, and `,` is literal there.
        return Err(PatternSyntaxError::new(
            parser.pos,
            "unbalanced '}': no '{' opens it",
        ));
    }
    Ok(nodes)
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    /// Parses until the end, or (inside braces) until a `,` or `}` that ends the alternative.
    fn sequence(&mut self, depth: usize) -> Result<Vec<Node>, PatternSyntaxError> {
        let mut nodes = Vec::new();
        while let Some(c) = self.peek() {
            let start = self.pos;
            if !is_special(c) {
                let end = self.chars[start..]
                    .iter()
                    .position(|&c| is_special(c))
                    .map_or(self.chars.len(), |length| start + length);
                push_literal(&mut nodes, &self.chars[start..end]);
                self.pos = end;
                continue;
            }
            match c {
                '}' => {
                    if depth == 0 {
                        return Err(PatternSyntaxError::new(
                            start,
                            "unbalanced '}': no '{' opens it",
                        ));
                    }
                    break;
                }
                ',' if depth > 0 => break,
                '\\' => {
                    self.pos += 1;
                    let escaped = self.peek().ok_or_else(|| {
                        PatternSyntaxError::new(start, "trailing '\\' escapes nothing")
                    })?;
                    self.pos += 1;
                    push_literal(&mut nodes, &[escaped]);
                }
                '*' => {
                    if self.chars.get(self.pos + 1) == Some(&'*') {
                        if depth > 0 {
                            return Err(PatternSyntaxError::new(
                                start,
                                "'**' is not allowed inside braces",
                            ));
                        }
                        self.pos += 2;
                        nodes.push(Node::Globstar { position: start });
                    } else {
                        self.pos += 1;
                        nodes.push(Node::Star);
                    }
                }
                '?' => {
                    self.pos += 1;
                    nodes.push(Node::AnyChar);
                }
                '.' => {
                    self.pos += 1;
                    nodes.push(Node::Dot { position: start });
                }
                '[' => nodes.push(self.class()?),
                '<' => nodes.push(self.range()?),
                '{' => nodes.push(self.alternation(depth)?),
                other => {
                    self.pos += 1;
                    push_literal(&mut nodes, &[other]);
                }
            }
        }
        Ok(nodes)
    }

    fn class(&mut self) -> Result<Node, PatternSyntaxError> {
        let open = self.pos;
        self.pos += 1;
        let negated = self.peek() == Some('!');
        if negated {
            self.pos += 1;
        }
        let mut items = Vec::new();
        loop {
            let here = self.pos;
            let c = match self.peek() {
                None => {
                    return Err(PatternSyntaxError::new(
                        open,
                        "unbalanced '[': the class is never closed",
                    ))
                }
                Some(']') => {
                    self.pos += 1;
                    break;
                }
                Some('\\') => {
                    self.pos += 1;
                    let c = self.peek().ok_or_else(|| {
                        PatternSyntaxError::new(here, "trailing '\\' escapes nothing")
                    })?;
                    self.pos += 1;
                    c
                }
                Some(c) => {
                    self.pos += 1;
                    c
                }
            };
            let is_range = self.peek() == Some('-')
                && !matches!(self.chars.get(self.pos + 1), None | Some(']'));
            if is_range {
                self.pos += 1;
                let hi_pos = self.pos;
                let mut hi = self.chars[self.pos];
                self.pos += 1;
                if hi == '\\' {
                    hi = self.peek().ok_or_else(|| {
                        PatternSyntaxError::new(hi_pos, "trailing '\\' escapes nothing")
                    })?;
                    self.pos += 1;
                }
                if hi < c {
                    return Err(PatternSyntaxError::new(
                        here,
                        format!("reversed class range '{c}-{hi}'"),
                    ));
                }
                items.push(ClassItem::Range(c, hi));
            } else {
                items.push(ClassItem::Char(c));
            }
        }
        if items.is_empty() {
            return Err(PatternSyntaxError::new(open, "empty character class"));
        }
        Ok(Node::Class { negated, items })
    }

    fn range(&mut self) -> Result<Node, PatternSyntaxError> {
        let open = self.pos;
        let close = self.chars[open..]
            .iter()
            .position(|&c| c == '>')
            .map(|offset| open + offset)
            .ok_or_else(|| {
                PatternSyntaxError::new(open, "unbalanced '<': the range is never closed")
            })?;
        let body: String = self.chars[open + 1..close].iter().collect();
        let (lo_text, hi_text) = body.split_once('-').ok_or_else(|| {
            PatternSyntaxError::new(open, format!("range '<{body}>' is not of the form <lo-hi>"))
        })?;
        let parse_bound = |text: &str, offset: usize| -> Result<u64, PatternSyntaxError> {
            if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
                return Err(PatternSyntaxError::new(
                    offset,
                    format!("non-numeric range bound '{text}'"),
                ));
            }
            text.parse::<u64>()
                .ok()
                .filter(|&v| v <= MAX_RANGE_VALUE)
                .ok_or_else(|| {
                    PatternSyntaxError::new(
                        offset,
                        format!("range bound '{text}' exceeds {MAX_RANGE_VALUE}"),
                    )
                })
        };
        let lo = parse_bound(lo_text, open + 1)?;
        let hi = parse_bound(hi_text, open + 2 + lo_text.chars().count())?;
        if lo > hi {
            return Err(PatternSyntaxError::new(
                open,
                format!("reversed range <{lo}-{hi}>"),
            ));
        }
        self.pos = close + 1;
        Ok(Node::Range { lo, hi })
    }

    fn alternation(&mut self, depth: usize) -> Result<Node, PatternSyntaxError> {
        let open = self.pos;
        if depth + 1 > MAX_BRACE_DEPTH {
            return Err(PatternSyntaxError::new(
                open,
                format!("braces nested deeper than {MAX_BRACE_DEPTH}"),
            ));
        }
        self.pos += 1;
        let mut alternatives = Vec::new();
        loop {
            alternatives.push(self.sequence(depth + 1)?);
            match self.peek() {
                Some(',') => self.pos += 1,
                Some('}') => {
                    self.pos += 1;
                    return Ok(Node::Alternation {
                        position: open,
                        alternatives,
                    });
                }
                _ => {
                    return Err(PatternSyntaxError::new(
                        open,
                        "unbalanced '{': the alternation is never closed",
                    ))
                }
            }
        }
    }
}

/// Whether `c` means more than itself somewhere in a glob (elsewhere it is literal).
pub fn is_special(c: char) -> bool {
    matches!(c, '}' | ',' | '\\' | '*' | '?' | '.' | '[' | '<' | '{')
}

/// Appends literal characters, to the run the sequence ends with if it ends with one.
fn push_literal(nodes: &mut Vec<Node>, chars: &[char]) {
    if let Some(Node::Literal(run)) = nodes.last_mut() {
        run.extend(chars);
    } else {
        nodes.push(Node::Literal(chars.iter().collect()));
    }
}

/// Range bounds stay below 10^18 so every bound fits the numeral arithmetic of `range.rs`.
pub const MAX_RANGE_VALUE: u64 = 999_999_999_999_999_999;

#[cfg(test)]
mod tests {
    use super::*;

    fn error_at(text: &str) -> usize {
        parse_glob(text).expect_err(text).position
    }

    #[test]
    fn parses_every_element() {
        let nodes = parse_glob(r"a*?[!0-9_]<1-3>{x,y.z}\*.**").unwrap();
        assert_eq!(nodes[0], Node::Literal("a".into()));
        assert_eq!(nodes[1], Node::Star);
        assert_eq!(nodes[2], Node::AnyChar);
        assert_eq!(
            nodes[3],
            Node::Class {
                negated: true,
                items: vec![ClassItem::Range('0', '9'), ClassItem::Char('_')]
            }
        );
        assert_eq!(nodes[4], Node::Range { lo: 1, hi: 3 });
        assert!(
            matches!(&nodes[5], Node::Alternation { position: 15, alternatives } if alternatives.len() == 2)
        );
        assert_eq!(nodes[6], Node::Literal("*".into()));
        assert_eq!(nodes[7], Node::Dot { position: 24 });
        assert_eq!(nodes[8], Node::Globstar { position: 25 });
    }

    #[test]
    fn error_positions() {
        assert_eq!(error_at("ab[cd"), 2);
        assert_eq!(error_at("ab[]"), 2);
        assert_eq!(error_at("ab[!]"), 2);
        assert_eq!(error_at("a{b,c"), 1);
        assert_eq!(error_at("a{b,{c}"), 1);
        assert_eq!(error_at("ab}"), 2);
        assert_eq!(error_at("x<1-5"), 1);
        assert_eq!(error_at("x<5-1>"), 1);
        assert_eq!(error_at("x<a-5>"), 2);
        assert_eq!(error_at("x<1-b>"), 4);
        assert_eq!(error_at("x<12-b>"), 5);
        assert_eq!(error_at("x<15>"), 1);
        assert_eq!(error_at("x<1-99999999999999999999>"), 4);
        assert_eq!(error_at(r"abc\"), 3);
        assert_eq!(error_at("a.{b,**}"), 5);
        assert_eq!(error_at("[z-a]"), 1);
    }

    #[test]
    fn escapes_and_literal_punctuation() {
        assert_eq!(
            parse_glob(r"\{a\}").unwrap(),
            vec![Node::Literal("{a}".into())]
        );
        assert_eq!(
            parse_glob("a,b>]").unwrap(),
            vec![Node::Literal("a,b>]".into())]
        );
        assert_eq!(
            parse_glob(r"[\]a-]").unwrap(),
            vec![Node::Class {
                negated: false,
                items: vec![
                    ClassItem::Char(']'),
                    ClassItem::Char('a'),
                    ClassItem::Char('-')
                ]
            }]
        );
    }

    #[test]
    fn brace_depth_is_limited() {
        let deep = "{".repeat(MAX_BRACE_DEPTH + 1) + &"}".repeat(MAX_BRACE_DEPTH + 1);
        assert_eq!(error_at(&deep), MAX_BRACE_DEPTH);
        let ok = "{".repeat(MAX_BRACE_DEPTH) + "a" + &"}".repeat(MAX_BRACE_DEPTH);
        assert!(parse_glob(&ok).is_ok());
    }

    #[test]
    fn non_ascii_positions_count_characters() {
        assert_eq!(error_at("ü.[x"), 2);
    }
}
