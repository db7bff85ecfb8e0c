//! One FQN pattern (SPEC §2): parsed once, classified into the cheapest strategy that answers it.

pub mod ast;
pub mod range;
pub mod segments;

use std::borrow::Cow;

use ast::{ClassItem, Node, PatternSyntaxError};
use regex_automata::meta::Regex;
use regex_syntax::hir::Hir;

/// How a pattern is answered. The root FQN `""` is never given to a strategy: whether a pattern
/// selects the root is decided once, at compile time (`Pattern::matches_root`).
#[derive(Debug, Clone)]
pub enum Strategy {
    /// The root pattern `""`: it selects the root and nothing else.
    Root,
    /// A pattern without metacharacters: one hash lookup.
    Exact(String),
    /// A glob with metacharacters, which the set's lazy DFA runs as `Pattern::regex` (built only
    /// when the pattern is not one of a family).
    Glob,
    /// A `re:` regex the set's lazy DFA runs, anchored.
    Regex(String),
    /// A `re:` regex the DFA cannot run (Unicode word boundaries): a backtracking-free meta regex,
    /// asked for every name.
    Fallback(String),
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

impl PatternError {
    /// The message quotes the pattern and points at the offending character with a caret.
    pub fn message(&self) -> String {
        let shown: String = self.pattern.chars().flat_map(char::escape_debug).collect();
        let caret_column: usize = self
            .pattern
            .chars()
            .take(self.position)
            .map(|c| c.escape_debug().count())
            .sum();
        format!(
            "invalid pattern \"{shown}\": {}\n  {shown}\n  {}^",
            self.reason,
            " ".repeat(caret_column)
        )
    }
}

pub const REGEX_PREFIX: &str = "re:";

impl Pattern {
    pub fn compile(text: &str) -> Result<Pattern, PatternError> {
        let fail = |e: PatternSyntaxError| PatternError {
            pattern: text.to_owned(),
            position: e.position,
            reason: e.reason,
        };
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

    /// The anchored regular expression that answers the pattern (`None` for the root, which no
    /// regex is asked about).
    pub fn regex(&self) -> Option<Cow<'_, str>> {
        match &self.strategy {
            Strategy::Exact(name) => Some(Cow::Owned(format!("^{}$", regex_syntax::escape(name)))),
            Strategy::Glob => Some(Cow::Owned(glob_regex(&self.glob))),
            Strategy::Regex(regex) | Strategy::Fallback(regex) => Some(Cow::Borrowed(regex)),
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
    let anchored = format!("^(?:{regex})$");
    let whole = Regex::new(&anchored)
        .map_err(|e| PatternSyntaxError::new(offset, format!("invalid regex: {e}")))?;
    let matches_root = whole.is_match("");
    let strategy = if hir.properties().look_set().contains_word_unicode() {
        Strategy::Fallback(anchored)
    } else {
        Strategy::Regex(anchored)
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
                Node::Literal(c) => *c,
                _ => '.',
            })
            .collect()
    })
}

/// A glob as an anchored regular expression over the whole FQN.
pub fn glob_regex(nodes: &[Node]) -> String {
    let mut out = String::from("^");
    let mut i = 0;
    // True where the text so far ends at a segment boundary reached through `**.`.
    let mut at_segment_start = true;
    while i < nodes.len() {
        match (&nodes[i], nodes.get(i + 1)) {
            // `**.` at the start (or after another `**.`): zero or more leading segments.
            (Node::Globstar { .. }, Some(Node::Dot { .. })) if at_segment_start => {
                out.push_str(r"(?:[^.]*\.)*");
                i += 2;
                continue;
            }
            // `**` standing alone: any name at all.
            (Node::Globstar { .. }, None) if at_segment_start => out.push_str("(?s:.*)"),
            // `.**`: zero or more trailing or inner segments, each with its dot.
            (Node::Dot { .. }, Some(Node::Globstar { .. })) => {
                out.push_str(r"(?:\.[^.]*)*");
                i += 2;
                at_segment_start = false;
                continue;
            }
            (node, _) => push_node(&mut out, node),
        }
        at_segment_start = false;
        i += 1;
    }
    out.push('$');
    out
}

fn push_node(out: &mut String, node: &Node) {
    match node {
        Node::Literal(c) if c.is_ascii_alphanumeric() || *c == '_' => out.push(*c),
        Node::Literal(c) => regex_syntax::escape_into(c.encode_utf8(&mut [0; 4]), out),
        Node::Star => out.push_str("[^.]*"),
        Node::AnyChar => out.push_str("[^.]"),
        Node::Dot { .. } => out.push_str(r"\."),
        Node::Class { negated, items } => {
            out.push('[');
            if *negated {
                out.push_str("^.");
            }
            for item in items {
                match item {
                    ClassItem::Char(c) => push_class_char(out, *c),
                    ClassItem::Range(lo, hi) => {
                        push_class_char(out, *lo);
                        out.push('-');
                        push_class_char(out, *hi);
                    }
                }
            }
            // A class never matches '.', whatever it lists.
            if !*negated {
                out.push_str(r"&&[^.]");
            }
            out.push(']');
        }
        Node::Range { lo, hi } => out.push_str(&range::range_regex(*lo, *hi)),
        Node::Alternation { alternatives, .. } => {
            out.push_str("(?:");
            for (k, alternative) in alternatives.iter().enumerate() {
                if k > 0 {
                    out.push('|');
                }
                for inner in alternative {
                    push_node(out, inner);
                }
            }
            out.push(')');
        }
        // Braces never hold `**` (the parser rejects it) and top-level ones are handled above.
        Node::Globstar { .. } => out.push_str(r"[^.]*"),
    }
}

fn push_class_char(out: &mut String, c: char) {
    if c.is_ascii_punctuation() || c.is_whitespace() {
        out.push('\\');
        if c.is_whitespace() {
            out.push_str(&format!("x{{{:x}}}", c as u32));
            return;
        }
    }
    out.push(c);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full_match(pattern: &str, name: &str) -> bool {
        let compiled = Pattern::compile(pattern).unwrap();
        match (&compiled.strategy, compiled.regex()) {
            (Strategy::Exact(exact), _) => exact == name,
            (_, Some(re)) => Regex::new(&re).unwrap().is_match(name),
            (_, None) => name.is_empty(),
        }
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
    fn caret_counts_characters_not_bytes() {
        let err = Pattern::compile("ü.[").unwrap_err();
        assert_eq!(err.position, 2);
        assert!(err.message().ends_with("\n    ^"));
    }
}
