//! One FQN pattern: parsed once, classified into the cheapest strategy that answers it.

pub mod ast;
pub mod range;
pub mod segments;

use ast::{ClassItem, Node, PatternSyntaxError};
use regex_automata::meta::Regex;
use regex_syntax::hir::{Class, ClassUnicode, ClassUnicodeRange, Dot, Hir, Look, Repetition};

/// How a pattern is answered. The root FQN `""` is never given to a strategy: whether a pattern
/// selects the root is decided once, at compile time (`Pattern::matches_root`).
#[derive(Debug, Clone)]
pub enum Strategy {
    /// The root pattern `""`: it selects the root and nothing else.
    Root,
    /// A pattern without metacharacters: one hash lookup.
    Exact(String),
    /// A glob with metacharacters, which the set's lazy DFA runs as `Pattern::hir` (built only
    /// when the pattern is not one of a family).
    Glob,
    /// A `re:` regex the set's lazy DFA runs, anchored.
    Regex(Hir),
    /// A `re:` regex the DFA cannot run (Unicode word boundaries): a backtracking-free meta regex,
    /// asked for every name.
    Fallback(Hir),
}

#[derive(Debug, Clone)]
pub struct Pattern {
    pub text: String,
    pub strategy: Strategy,
    pub matches_root: bool,
    /// The parsed glob (empty for the root and `re:` patterns).
    pub glob: Vec<Node>,
}

/// A malformed pattern: the whole text, a character position and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternError {
    pub pattern: String,
    pub position: usize,
    pub reason: String,
}

/// How many characters of a long pattern a message shows, around the error.
const SHOWN_CHARS: usize = 80;

impl PatternError {
    /// The message quotes the pattern and points at the offending character with a caret; a
    /// pattern longer than `SHOWN_CHARS` is shown around that character, cut ends marked `…`.
    pub fn message(&self) -> String {
        let chars: Vec<char> = self.pattern.chars().collect();
        let position = self.position.min(chars.len());
        let start = position
            .saturating_sub(SHOWN_CHARS / 2)
            .min(chars.len().saturating_sub(SHOWN_CHARS));
        let end = chars.len().min(start + SHOWN_CHARS);
        let escaped =
            |part: &[char]| -> String { part.iter().flat_map(|c| c.escape_debug()).collect() };
        let lead = if start > 0 { "…" } else { "" };
        let trail = if end < chars.len() { "…" } else { "" };
        let shown = format!("{lead}{}{trail}", escaped(&chars[start..end]));
        let caret_column = lead.chars().count() + escaped(&chars[start..position]).chars().count();
        let length = if lead.is_empty() && trail.is_empty() {
            String::new()
        } else {
            format!(" ({} characters)", chars.len())
        };
        format!(
            "invalid pattern \"{shown}\"{length}: {}\n  {shown}\n  {}^",
            self.reason,
            " ".repeat(caret_column)
        )
    }
}

pub const REGEX_PREFIX: &str = "re:";

/// The longest pattern, in characters (a documented limit, see README): real FQN patterns are a
/// few hundred at most, and the limit keeps compiling and matching any pattern cheap.
pub const MAX_PATTERN_CHARS: usize = 4096;

impl Pattern {
    pub fn compile(text: &str) -> Result<Pattern, PatternError> {
        let fail = |e: PatternSyntaxError| PatternError {
            pattern: text.to_owned(),
            position: e.position,
            reason: e.reason,
        };
        let length = text.chars().count();
        if length > MAX_PATTERN_CHARS {
            return Err(fail(PatternSyntaxError::new(
                MAX_PATTERN_CHARS,
                format!(
                    "a pattern of {length} characters exceeds the limit of {MAX_PATTERN_CHARS}"
                ),
            )));
        }
        if text.is_empty() {
            return Ok(Pattern {
                text: String::new(),
                strategy: Strategy::Root,
                matches_root: true,
                glob: Vec::new(),
            });
        }
        if let Some(regex) = text.strip_prefix(REGEX_PREFIX) {
            return compile_regex(text, regex).map_err(fail);
        }
        let nodes = ast::parse_glob(text).map_err(fail)?;
        segments::check_segments(&nodes).map_err(fail)?;
        let matches_root = nodes
            .iter()
            .all(|n| matches!(n, Node::Globstar { .. } | Node::Dot { .. }));
        let strategy = match literal_text(&nodes) {
            Some(exact) => Strategy::Exact(exact),
            None => Strategy::Glob,
        };
        Ok(Pattern {
            text: text.to_owned(),
            strategy,
            matches_root,
            glob: nodes,
        })
    }

    /// The anchored regular expression that answers the pattern, as the syntax tree the
    /// automata compile from (`None` for the root, which no regex is asked about). Globs are
    /// translated straight into it: no regex text is written only to be parsed again.
    pub fn hir(&self) -> Option<Hir> {
        match &self.strategy {
            Strategy::Exact(name) => Some(anchored(Hir::literal(name.as_bytes()))),
            Strategy::Glob => Some(glob_hir(&self.glob)),
            Strategy::Regex(hir) | Strategy::Fallback(hir) => Some(hir.clone()),
            Strategy::Root => None,
        }
    }
}

fn compile_regex(text: &str, regex: &str) -> Result<Pattern, PatternSyntaxError> {
    let offset = REGEX_PREFIX.len();
    let hir: Hir = regex_syntax::Parser::new().parse(regex).map_err(|e| {
        let (byte, reason) = match &e {
            regex_syntax::Error::Parse(e) => (e.span().start.offset, e.kind().to_string()),
            regex_syntax::Error::Translate(e) => (e.span().start.offset, e.kind().to_string()),
            other => (0, other.to_string()),
        };
        PatternSyntaxError::new(
            offset + regex[..byte].chars().count(),
            format!("invalid regex: {reason}"),
        )
    })?;
    let word_unicode = hir.properties().look_set().contains_word_unicode();
    let whole = anchored(hir);
    let matches_root = Regex::builder()
        .build_from_hir(&whole)
        .map_err(|e| PatternSyntaxError::new(offset, format!("invalid regex: {e}")))?
        .is_match("");
    let strategy = if word_unicode {
        Strategy::Fallback(whole)
    } else {
        Strategy::Regex(whole)
    };
    Ok(Pattern {
        text: text.to_owned(),
        strategy,
        matches_root,
        glob: Vec::new(),
    })
}

/// The exact FQN a glob denotes when it has no metacharacters.
fn literal_text(nodes: &[Node]) -> Option<String> {
    // Checked before collecting: most globs have a metacharacter, and a string half built for
    // nothing is an allocation per pattern.
    let is_literal = |node: &Node| matches!(node, Node::Literal(_) | Node::Dot { .. });
    nodes.iter().all(is_literal).then(|| {
        nodes
            .iter()
            .map(|node| match node {
                Node::Literal(run) => run.as_str(),
                _ => ".",
            })
            .collect()
    })
}

/// `hir` matching whole FQNs only.
fn anchored(hir: Hir) -> Hir {
    Hir::concat(vec![Hir::look(Look::Start), hir, Hir::look(Look::End)])
}

/// A glob as an anchored regular expression over the whole FQN.
pub fn glob_hir(nodes: &[Node]) -> Hir {
    let mut out = Concat::default();
    out.push(Hir::look(Look::Start));
    let mut i = 0;
    // True where the text so far ends at a segment boundary reached through `**.`.
    let mut at_segment_start = true;
    while i < nodes.len() {
        match (&nodes[i], nodes.get(i + 1)) {
            // `**.` at the start (or after another `**.`): zero or more leading segments.
            (Node::Globstar { .. }, Some(Node::Dot { .. })) if at_segment_start => {
                out.push(any_number(Hir::concat(vec![segment_text(), dot()])));
                i += 2;
                continue;
            }
            // `**` standing alone: any name at all.
            (Node::Globstar { .. }, None) if at_segment_start => {
                out.push(any_number(Hir::dot(Dot::AnyChar)));
            }
            // `.**`: zero or more trailing or inner segments, each with its dot.
            (Node::Dot { .. }, Some(Node::Globstar { .. })) => {
                out.push(any_number(Hir::concat(vec![dot(), segment_text()])));
                i += 2;
                at_segment_start = false;
                continue;
            }
            (node, _) => out.push_node(node),
        }
        at_segment_start = false;
        i += 1;
    }
    out.push(Hir::look(Look::End));
    out.finish()
}

/// A concatenation built node by node, each run of literal characters one literal.
#[derive(Default)]
struct Concat {
    parts: Vec<Hir>,
    literal: String,
}

impl Concat {
    fn push(&mut self, hir: Hir) {
        self.flush_literal();
        self.parts.push(hir);
    }

    fn flush_literal(&mut self) {
        if !self.literal.is_empty() {
            self.parts
                .push(Hir::literal(std::mem::take(&mut self.literal).into_bytes()));
        }
    }

    fn push_node(&mut self, node: &Node) {
        match node {
            Node::Literal(run) => self.literal.push_str(run),
            Node::Dot { .. } => self.literal.push('.'),
            // Braces never hold `**` (the parser rejects it) and top-level ones are handled above.
            Node::Star | Node::Globstar { .. } => self.push(segment_text()),
            Node::AnyChar => self.push(Hir::class(Class::Unicode(non_dot()))),
            Node::Class { negated, items } => {
                let mut class = ClassUnicode::new(items.iter().map(|item| match *item {
                    ClassItem::Char(c) => ClassUnicodeRange::new(c, c),
                    ClassItem::Range(lo, hi) => ClassUnicodeRange::new(lo, hi),
                }));
                // A class never matches '.', whatever it lists.
                if *negated {
                    class.push(ClassUnicodeRange::new('.', '.'));
                    class.negate();
                } else {
                    class.intersect(&non_dot());
                }
                self.push(Hir::class(Class::Unicode(class)));
            }
            Node::Range { lo, hi } => self.push(range::range_hir(*lo, *hi)),
            Node::Alternation { alternatives, .. } => {
                let alternatives = alternatives.iter().map(|alternative| {
                    let mut inner = Concat::default();
                    for node in alternative {
                        inner.push_node(node);
                    }
                    inner.finish()
                });
                self.push(Hir::alternation(alternatives.collect()));
            }
        }
    }

    fn finish(mut self) -> Hir {
        if self.parts.is_empty() {
            return Hir::literal(self.literal.into_bytes());
        }
        self.flush_literal();
        Hir::concat(self.parts)
    }
}

fn dot() -> Hir {
    Hir::literal(*b".")
}

/// Any character but `.`.
fn non_dot() -> ClassUnicode {
    let mut class = ClassUnicode::new([ClassUnicodeRange::new('.', '.')]);
    class.negate();
    class
}

/// Any run of characters but `.`: the text of (part of) one segment.
fn segment_text() -> Hir {
    any_number(Hir::class(Class::Unicode(non_dot())))
}

fn any_number(hir: Hir) -> Hir {
    Hir::repetition(Repetition {
        min: 0,
        max: None,
        greedy: true,
        sub: Box::new(hir),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full_match(pattern: &str, name: &str) -> bool {
        let compiled = Pattern::compile(pattern).unwrap();
        match (&compiled.strategy, compiled.hir()) {
            (Strategy::Exact(exact), _) => exact == name,
            (_, Some(hir)) => Regex::builder()
                .build_from_hir(&hir)
                .unwrap()
                .is_match(name),
            (_, None) => name.is_empty(),
        }
    }

    #[test]
    fn refuses_a_pattern_over_the_length_limit() {
        let at_limit = "a".repeat(MAX_PATTERN_CHARS);
        assert!(Pattern::compile(&at_limit).is_ok());
        let error = Pattern::compile(&(at_limit + "a")).unwrap_err();
        assert_eq!(error.position, MAX_PATTERN_CHARS);
        assert!(error.reason.contains("exceeds the limit of 4096"));
    }

    #[test]
    fn classifies_strategies() {
        assert!(matches!(
            Pattern::compile("").unwrap().strategy,
            Strategy::Root
        ));
        assert!(
            matches!(Pattern::compile(r"a.b\*").unwrap().strategy, Strategy::Exact(ref s) if s == "a.b*")
        );
        assert!(matches!(
            Pattern::compile("a.*").unwrap().strategy,
            Strategy::Glob
        ));
        assert!(matches!(
            Pattern::compile(r"re:\bx").unwrap().strategy,
            Strategy::Fallback(_)
        ));
        assert!(matches!(
            Pattern::compile(r"re:(?-u:\b)x").unwrap().strategy,
            Strategy::Regex(_)
        ));
    }

    #[test]
    fn root_rule() {
        for (pattern, root) in [
            ("", true),
            ("**", true),
            ("**.**", true),
            ("*", false),
            ("{a,}", false),
            ("re:a*", true),
            ("re:a+", false),
        ] {
            assert_eq!(
                Pattern::compile(pattern).unwrap().matches_root,
                root,
                "{pattern}"
            );
        }
    }

    #[test]
    fn globstar_forms() {
        assert!(full_match("a.**", "a"));
        assert!(full_match("a.**", "a.b.c"));
        assert!(!full_match("a.**", "ab"));
        assert!(full_match("**.down_proj", "down_proj"));
        assert!(full_match("**.down_proj", "x.y.down_proj"));
        assert!(!full_match("**.down_proj", "xdown_proj"));
        assert!(full_match("a.**.b", "a.b"));
        assert!(full_match("a.**.b", "a.x.y.b"));
        assert!(!full_match("a.**.b", "a.xb"));
        assert!(full_match("**", "any.thing"));
    }

    #[test]
    fn classes_never_match_dot() {
        assert!(!full_match("a[.x]b", "a.b"));
        assert!(full_match("a[.x]b", "axb"));
        assert!(!full_match("a[!x]b", "a.b"));
        assert!(full_match("a[!x]b", "ayb"));
        assert!(full_match("[ -]", " "));
        assert!(full_match(r"[\]]", "]"));
    }

    #[test]
    fn regex_errors_point_into_the_regex() {
        let err = Pattern::compile("re:ab(c").unwrap_err();
        assert_eq!(err.position, 5);
        assert!(err.reason.starts_with("invalid regex"));
        let message = err.message();
        assert!(message.contains("\"re:ab(c\""), "{message}");
        assert!(message.ends_with("\n       ^"), "{message:?}");
    }

    #[test]
    fn a_long_pattern_is_shown_around_the_error() {
        let text = format!("{}.[{}", "a".repeat(200), "b".repeat(200));
        let err = Pattern::compile(&text).unwrap_err();
        assert_eq!(err.position, 201);
        let message = err.message();
        let shown = format!("…{}.[{}…", "a".repeat(39), "b".repeat(39));
        assert!(
            message.starts_with(&format!("invalid pattern \"{shown}\" (402 characters): ")),
            "{message}"
        );
        let caret = format!("\n  {}^", " ".repeat(41));
        assert!(message.ends_with(&caret), "{message:?}");
        assert_eq!(message.lines().count(), 3);
    }

    #[test]
    fn caret_counts_characters_not_bytes() {
        let err = Pattern::compile("ü.[").unwrap_err();
        assert_eq!(err.position, 2);
        assert!(err.message().ends_with("\n    ^"));
    }
}
