//! Pattern families. Generated plans repeat one pattern per layer (`layers.0.mlp.gate`,
//! `layers.1.mlp.gate`, … `layers.60.mlp.gate`). Patterns that are the same but for one literal
//! segment join the DFA as a single pattern whose segment is an alternation of theirs; which
//! member matched is then read off that segment of the name. The DFA gets one pattern where it
//! had dozens: it compiles faster, and the states past the varying segment are shared by every
//! member instead of being built once per member.
//!
//! The varying segment must sit at a fixed position in every name the family matches, so only
//! segments with no `**`, no braces (which may hold dots) and no escaped `.` before them vary.

use std::ops::Range;

use regex_syntax::hir::Hir;
use rustc_hash::FxHashMap;

use crate::pattern::ast::Node;
use crate::pattern::{glob_hir, Pattern};

/// Fewer members than this stay separate patterns: telling members apart costs a lookup per
/// match, which a few members do not repay in DFA states saved.
const MIN_MEMBERS: usize = 8;

pub struct Family {
    /// Which dot-separated segment of a name tells the members apart.
    pub segment: usize,
    /// The DFA pattern: the members' shared glob, its varying segment an alternation.
    pub hir: Hir,
    /// Each member's literal segment and its pattern indices (a repeated pattern has several).
    pub members: FxHashMap<String, Vec<u32>>,
}

impl Family {
    /// The segment of `name` that tells the members apart.
    pub fn segment_of<'n>(&self, name: &'n str) -> &'n str {
        let bytes = name.as_bytes();
        let mut start = 0;
        for _ in 0..self.segment {
            match bytes[start..].iter().position(|&b| b == b'.') {
                Some(dot) => start += dot + 1,
                None => return "",
            }
        }
        let end = bytes[start..]
            .iter()
            .position(|&b| b == b'.')
            .map_or(bytes.len(), |dot| start + dot);
        &name[start..end]
    }

    /// The member literal equal to `segment`, and its patterns.
    pub fn member(&self, segment: &str) -> Option<(&str, &[u32])> {
        self.members
            .get_key_value(segment)
            .map(|(literal, members)| (literal.as_str(), members.as_slice()))
    }
}

/// Per family, the member last asked for. A walk visits a layer's whole subtree in a row, and a
/// generated plan's families vary in the layer, so one entry per family answers nearly every
/// match without hashing the segment again.
pub struct RecentMembers<'a> {
    recent: Vec<Option<(&'a str, &'a [u32])>>,
}

impl<'a> RecentMembers<'a> {
    pub fn new(families: usize) -> Self {
        RecentMembers {
            recent: vec![None; families],
        }
    }

    /// The members of `families[which]` matching `name`, a name the family's regex matched.
    pub fn members_of(&mut self, families: &'a [Family], which: usize, name: &str) -> &'a [u32] {
        let family = &families[which];
        let segment = family.segment_of(name);
        if let Some((literal, members)) = self.recent[which] {
            // Member literals are short (a layer's number): a byte loop, not a call to memcmp.
            if literal.len() == segment.len()
                && literal.bytes().zip(segment.bytes()).all(|(a, b)| a == b)
            {
                return members;
            }
        }
        let found = family.member(segment);
        if found.is_some() {
            self.recent[which] = found;
        }
        found.map_or(&[], |(_, members)| members)
    }
}

/// A literal segment of one pattern, and the rest of the pattern around it.
struct LiteralSegment<'p> {
    segment: usize,
    /// The top-level glob nodes the segment spans (literals only).
    nodes: Range<usize>,
    /// The pattern text before and after the segment.
    around: (&'p str, &'p str),
}

/// The families among the glob patterns, largest first; each pattern joins at most one.
pub fn find_families(patterns: &[Pattern]) -> Vec<Family> {
    type Key<'p> = (usize, (&'p str, &'p str));
    // Most literal segments are shared by no other pattern, so groups are only counted at first
    // (no member list per segment), and members are gathered for the large groups alone.
    let mut group_of: FxHashMap<Key<'_>, usize> =
        FxHashMap::with_capacity_and_hasher(patterns.len() * 4, Default::default());
    let mut sizes: Vec<usize> = Vec::with_capacity(patterns.len() * 4);
    let mut candidates: Vec<(usize, u32, Range<usize>)> = Vec::with_capacity(patterns.len() * 4);
    let mut found = Vec::new();
    for (index, pattern) in (0u32..).zip(patterns) {
        literal_segments(&pattern.text, &pattern.glob, &mut found);
        for segment in found.drain(..) {
            let next = sizes.len();
            let group = *group_of
                .entry((segment.segment, segment.around))
                .or_insert(next);
            if group == next {
                sizes.push(0);
            }
            sizes[group] += 1;
            candidates.push((group, index, segment.nodes));
        }
    }
    let mut large: Vec<(Key<'_>, usize)> = group_of
        .into_iter()
        .filter(|&(_, group)| sizes[group] >= MIN_MEMBERS)
        .collect();
    // A fixed order, so a set always compiles the same way.
    large.sort_unstable_by(|(a_key, a), (b_key, b)| {
        sizes[*b].cmp(&sizes[*a]).then_with(|| a_key.cmp(b_key))
    });
    let mut rank = vec![usize::MAX; sizes.len()];
    for (position, &(_, group)) in large.iter().enumerate() {
        rank[group] = position;
    }
    let mut members: Vec<Vec<(u32, Range<usize>)>> = vec![Vec::new(); large.len()];
    for (group, index, nodes) in candidates {
        if let Some(list) = members.get_mut(rank[group]) {
            list.push((index, nodes));
        }
    }
    let mut joined = vec![false; patterns.len()];
    let mut families = Vec::new();
    for (((segment, _), _), members) in large.into_iter().zip(members) {
        let free: Vec<_> = members
            .into_iter()
            .filter(|(index, _)| !joined[*index as usize])
            .collect();
        if free.len() < MIN_MEMBERS {
            continue;
        }
        let mut by_literal: FxHashMap<String, Vec<u32>> = FxHashMap::default();
        for (index, nodes) in &free {
            joined[*index as usize] = true;
            let literal: String = patterns[*index as usize].glob[nodes.clone()]
                .iter()
                .filter_map(|node| match node {
                    Node::Literal(c) => Some(*c),
                    _ => None,
                })
                .collect();
            by_literal.entry(literal).or_default().push(*index);
        }
        let mut literals: Vec<&String> = by_literal.keys().collect();
        literals.sort_unstable();
        let alternation = Node::Alternation {
            position: 0,
            alternatives: literals
                .iter()
                .map(|literal| literal.chars().map(Node::Literal).collect())
                .collect(),
        };
        let (first, nodes) = &free[0];
        let glob = &patterns[*first as usize].glob;
        let mut family_glob = glob[..nodes.start].to_vec();
        family_glob.push(alternation);
        family_glob.extend_from_slice(&glob[nodes.end..]);
        families.push(Family {
            segment,
            hir: glob_hir(&family_glob),
            members: by_literal,
        });
    }
    families
}

/// The segments of a glob that are plain literals and sit at a fixed position in every name the
/// glob matches (nothing before them spans a varying number of segments).
fn literal_segments<'p>(text: &'p str, glob: &[Node], found: &mut Vec<LiteralSegment<'p>>) {
    // Dot positions count characters; they ascend, so one pass over the text finds their bytes.
    let mut chars = text.char_indices().enumerate();
    let mut byte_at = |position: usize| {
        chars
            .find(|&(count, _)| count == position)
            .map_or(text.len(), |(_, (byte, _))| byte)
    };
    let (mut segment, mut first_node, mut start_byte) = (0, 0, 0);
    for index in 0..=glob.len() {
        let end_byte = match glob.get(index) {
            Some(Node::Dot { position }) => byte_at(*position),
            None => text.len(),
            Some(_) => continue,
        };
        let nodes = &glob[first_node..index];
        // An escaped `.` makes a segment of the pattern two segments of the name.
        let spans_segments = nodes.iter().any(|node| {
            matches!(
                node,
                Node::Globstar { .. } | Node::Alternation { .. } | Node::Literal('.')
            )
        });
        if spans_segments {
            break;
        }
        if !nodes.is_empty() && nodes.iter().all(|node| matches!(node, Node::Literal(_))) {
            found.push(LiteralSegment {
                segment,
                nodes: first_node..index,
                around: (&text[..start_byte], &text[end_byte..]),
            });
        }
        segment += 1;
        first_node = index + 1;
        start_byte = end_byte + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The members matching `name`, a name the family's regex matched.
    fn members_of<'f>(family: &'f Family, name: &str) -> &'f [u32] {
        family
            .member(family.segment_of(name))
            .map_or(&[], |(_, members)| members)
    }

    /// Whether the family's DFA pattern matches `name`.
    fn accepts(family: &Family, name: &str) -> bool {
        regex_automata::meta::Regex::builder()
            .build_from_hir(&family.hir)
            .unwrap()
            .is_match(name)
    }

    fn families(texts: &[&str]) -> Vec<Family> {
        let patterns: Vec<Pattern> = texts.iter().map(|t| Pattern::compile(t).unwrap()).collect();
        find_families(&patterns)
    }

    #[test]
    fn one_family_per_repeated_pattern_of_a_generated_plan() {
        let mut texts = Vec::new();
        for layer in 0..12 {
            texts.push(format!("layers.{layer}.mlp.experts.*.gate_proj"));
            texts.push(format!("layers.{layer}.mlp.gate"));
        }
        texts.push("lm_head".to_owned());
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let found = families(&texts);
        assert_eq!(found.len(), 2);
        for family in &found {
            assert_eq!(family.segment, 1);
            assert_eq!(family.members.len(), 12);
        }
        let gate = found
            .iter()
            .find(|f| accepts(f, "layers.7.mlp.gate"))
            .unwrap();
        assert!(!accepts(gate, "layers.7.mlp.experts.0.gate_proj"));
        assert_eq!(members_of(gate, "layers.7.mlp.gate"), &[15]);
        assert_eq!(members_of(gate, "layers.70.mlp.gate"), &[] as &[u32]);
    }

    /// `template` with `#` replaced by each of `literals`.
    fn each(template: &str, literals: &[&str]) -> Vec<String> {
        literals.iter().map(|l| template.replace('#', l)).collect()
    }

    const EIGHT: [&str; 8] = ["a", "b", "c", "d", "e", "f", "g", "h"];

    fn families_of(texts: &[String]) -> Vec<Family> {
        families(&texts.iter().map(String::as_str).collect::<Vec<_>>())
    }

    #[test]
    fn repeated_patterns_are_members_under_one_literal() {
        let mut texts = each("a.#.b", &EIGHT);
        texts.push("a.a.b".to_owned());
        let found = families_of(&texts);
        assert_eq!(found.len(), 1);
        assert_eq!(members_of(&found[0], "a.a.b"), &[0, 8]);
        assert_eq!(members_of(&found[0], "a.c.b"), &[2]);
    }

    #[test]
    fn recent_members_follow_the_segment_of_each_name() {
        let mut texts = each("a.#.b", &EIGHT);
        texts.extend(each("#.c", &EIGHT));
        let found = families_of(&texts);
        let mut recent = RecentMembers::new(found.len());
        let which = |segment: usize| found.iter().position(|f| f.segment == segment).unwrap();
        let (middle, first) = (which(1), which(0));
        for (family, name, expected) in [
            (middle, "a.c.b", &[2][..]),
            (middle, "a.c.b", &[2]),
            (middle, "a.d.b", &[3]),
            (first, "d.c", &[11]),
            (middle, "a.c.b", &[2]),
            (first, "h.c", &[15]),
            (middle, "a.x.b", &[]),
            (middle, "a.c.b", &[2]),
        ] {
            assert_eq!(recent.members_of(&found, family, name), expected, "{name}");
        }
    }

    #[test]
    fn the_varying_segment_is_found_at_its_position() {
        let found = families_of(&each("a.b.#.c", &EIGHT));
        assert_eq!(found[0].segment_of("a.b.xyz.c"), "xyz");
        assert_eq!(found[0].segment_of("a.b.xyz"), "xyz");
        assert_eq!(found[0].segment_of("a.b"), "");
        assert_eq!(found[0].segment_of("a..."), "");
    }

    #[test]
    fn too_few_members_stay_separate() {
        assert!(families_of(&each("a.#.b", &EIGHT[..7])).is_empty());
    }

    #[test]
    fn no_segment_varies_after_a_globstar_or_braces() {
        assert!(families_of(&each("**.#.b", &EIGHT)).is_empty());
        assert!(families_of(&each("{a,c.d}.#.b", &EIGHT)).is_empty());
        assert!(families_of(&each(r"a\.b.#.c", &EIGHT)).is_empty());
        assert!(families_of(&each(r"x\.#.c", &EIGHT)).is_empty());
        // Before them, a segment may vary.
        assert_eq!(families_of(&each("#.**.b", &EIGHT)).len(), 1);
    }

    #[test]
    fn escaped_literals_are_compared_unescaped() {
        let found = families_of(&each(r"a.#\*.b", &EIGHT));
        assert_eq!(found.len(), 1);
        assert_eq!(members_of(&found[0], "a.c*.b"), &[2]);
        assert!(accepts(&found[0], "a.c*.b"));
        for name in ["a.cx.b", "a.c.b", "a.x*.b", "a.c*.bb"] {
            assert!(!accepts(&found[0], name), "{name}");
        }
    }

    #[test]
    fn each_pattern_joins_the_largest_family_only() {
        // `a.up` could join the `#.up` family (segment 0, nine members) or the `a.#` one
        // (segment 1, eight members, then seven without it: too few).
        let mut texts = each("#.up", &[&EIGHT[..], &["i"]].concat());
        texts.extend(each("a.#", &["p", "q", "r", "s", "t", "u", "v"]));
        let found = families_of(&texts);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].segment, 0);
        assert_eq!(found[0].members.len(), 9);
    }
}
