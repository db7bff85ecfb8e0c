//! Whole-segment rules: no empty segment, `**` only as a whole segment, and the
//! documented limit on brace expansion.
//!
//! Braces may hold dots, so a segment can start in one alternative and end in another. The rules
//! are therefore checked on every expansion of the braces, which the expansion limit keeps small.

use super::ast::{Node, PatternSyntaxError};

/// The most brace expansions one pattern may denote (a documented limit, see README).
pub const MAX_EXPANSIONS: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    Dot(usize),
    Globstar(usize),
    Content,
}

/// Checks the segment rules on every expansion of `nodes`.
pub fn check_segments(nodes: &[Node]) -> Result<(), PatternSyntaxError> {
    check_expansion_count(nodes)?;
    let expansions = expand(nodes);
    if expansions.iter().all(Vec::is_empty) {
        return Err(PatternSyntaxError::new(
            0,
            "the pattern only expands to an empty name; write \"\" for the root",
        ));
    }
    // An empty expansion would only match the root, which no glob but `**` selects.
    for expansion in expansions.iter().filter(|e| !e.is_empty()) {
        check_expansion(expansion)?;
    }
    Ok(())
}

fn check_expansion_count(nodes: &[Node]) -> Result<(), PatternSyntaxError> {
    let mut product: usize = 1;
    for node in nodes {
        if let Node::Alternation {
            position,
            alternatives,
        } = node
        {
            let mut sum: usize = 0;
            for alternative in alternatives {
                check_expansion_count(alternative)?;
                sum = sum.saturating_add(expansion_count(alternative));
            }
            product = product.saturating_mul(sum);
            if product > MAX_EXPANSIONS {
                return Err(PatternSyntaxError::new(
                    *position,
                    format!("brace expansion exceeds the limit of {MAX_EXPANSIONS} alternatives"),
                ));
            }
        }
    }
    Ok(())
}

fn expansion_count(nodes: &[Node]) -> usize {
    nodes.iter().fold(1usize, |product, node| match node {
        Node::Alternation { alternatives, .. } => product.saturating_mul(
            alternatives
                .iter()
                .map(|a| expansion_count(a))
                .fold(0, usize::saturating_add),
        ),
        _ => product,
    })
}

fn expand(nodes: &[Node]) -> Vec<Vec<Token>> {
    let mut expansions: Vec<Vec<Token>> = vec![Vec::with_capacity(nodes.len())];
    for node in nodes {
        let token = match node {
            Node::Dot { position } => Token::Dot(*position),
            Node::Globstar { position } => Token::Globstar(*position),
            Node::Alternation { alternatives, .. } => {
                let tails: Vec<Vec<Token>> = alternatives.iter().flat_map(|a| expand(a)).collect();
                expansions = expansions
                    .iter()
                    .flat_map(|head| {
                        tails.iter().map(move |tail| {
                            let mut joined = head.clone();
                            for &token in tail {
                                push_token(&mut joined, token);
                            }
                            joined
                        })
                    })
                    .collect();
                continue;
            }
            _ => Token::Content,
        };
        for expansion in &mut expansions {
            push_token(expansion, token);
        }
    }
    expansions
}

/// Consecutive content collapses into one token: only the boundaries matter here.
fn push_token(tokens: &mut Vec<Token>, token: Token) {
    if !(token == Token::Content && tokens.last() == Some(&Token::Content)) {
        tokens.push(token);
    }
}

fn check_expansion(tokens: &[Token]) -> Result<(), PatternSyntaxError> {
    for (i, token) in tokens.iter().enumerate() {
        let before = i.checked_sub(1).map(|j| tokens[j]);
        let after = tokens.get(i + 1).copied();
        match *token {
            Token::Dot(position) => {
                if before.is_none() || matches!(before, Some(Token::Dot(_))) {
                    return Err(PatternSyntaxError::new(
                        position,
                        "empty segment before '.'",
                    ));
                }
                if after.is_none() {
                    return Err(PatternSyntaxError::new(
                        position,
                        "empty segment after a trailing '.'",
                    ));
                }
            }
            Token::Globstar(position) => {
                let whole = matches!(before, None | Some(Token::Dot(_)))
                    && matches!(after, None | Some(Token::Dot(_)));
                if !whole {
                    return Err(PatternSyntaxError::new(
                        position,
                        "'**' must be a whole segment",
                    ));
                }
            }
            Token::Content => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pattern::ast::parse_glob;

    fn check(text: &str) -> Result<(), PatternSyntaxError> {
        check_segments(&parse_glob(text).unwrap())
    }

    #[test]
    fn accepts_whole_segments() {
        for ok in [
            "a",
            "a.b",
            "**",
            "**.x",
            "a.**",
            "a.**.b",
            "**.**",
            "{a,b.c}.d",
            "a{.b,}",
            "x.{a,b*}",
        ] {
            assert!(check(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_empty_segments_with_position() {
        assert_eq!(check("a..b").unwrap_err().position, 2);
        assert_eq!(check(".a").unwrap_err().position, 0);
        assert_eq!(check("a.").unwrap_err().position, 1);
        assert_eq!(check("a.{.b,c}").unwrap_err().position, 3);
        assert_eq!(check("x.{a,}").unwrap_err().position, 1);
    }

    #[test]
    fn rejects_partial_globstar() {
        assert_eq!(check("a**").unwrap_err().position, 1);
        assert_eq!(check("**b").unwrap_err().position, 0);
        assert_eq!(check("a.***").unwrap_err().position, 2);
        assert_eq!(check("{a,b}**").unwrap_err().position, 5);
    }

    #[test]
    fn rejects_patterns_that_expand_to_nothing() {
        assert_eq!(check("{,}").unwrap_err().position, 0);
        assert!(check("{a,}").is_ok());
    }

    #[test]
    fn limits_expansion() {
        let ten = "{a,b,c,d,e,f,g,h,i,j}";
        assert!(check(&ten.repeat(3)).is_ok());
        let err = check(&ten.repeat(4)).unwrap_err();
        assert_eq!(err.position, 3 * ten.len());
        assert!(err.reason.contains("1024"));
    }
}
