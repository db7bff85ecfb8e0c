//! Pattern families. Generated plans repeat one pattern per layer (`layers.0.mlp.gate`,
//! `layers.1.mlp.gate`, … `layers.60.mlp.gate`). Patterns that are the same but for one literal
//! segment join the DFA as a single pattern whose segment is an alternation of theirs; which
//! member matched is then read off that segment of the name. The DFA gets one pattern where it
//! had dozens: it compiles faster, and the states past the varying segment are shared by every
//! member instead of being built once per member.
//!
//! Families are found on the texts, before parsing, so that a member is not parsed at all: a
//! generated plan's 490 patterns are 8 families, and parsing 8 patterns instead of 490 is most
//! of what compiling it saves. The varying segment must sit at a fixed position in every name the
//! family matches, so only segments with no `**`, no braces or classes (which may hold dots) and
//! no escape before them vary; and it must be plain (no character that means more than itself
//! anywhere in a glob), so that every member parses as the first one does.

use std::ops::Range;

use regex_syntax::hir::Hir;
use rustc_hash::FxHashMap;

use crate::pattern::ast::{is_special, Node};
use crate::pattern::{glob_hir, Pattern, MAX_PATTERN_CHARS, REGEX_PREFIX};

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

/// Patterns found to be the same but for one plain segment, before any of them is parsed.
pub struct FamilyDraft<'t> {
    /// Which dot-separated segment varies.
    pub segment: usize,
    /// Each member's index and varying segment, ascending by index.
    pub members: Vec<(u32, &'t str)>,
}

/// The families among the pattern texts, largest first; each text joins at most one. Found on
/// the texts alone, so that only each family's first member needs parsing: the others differ
/// from it in one segment of characters that are literal anywhere, before anything that could
/// hide or span a dot, so they parse as it does with that one literal replaced.
pub fn draft_families<'t>(texts: &[&'t str]) -> Vec<FamilyDraft<'t>> {
    type Key<'t> = (usize, (&'t str, &'t str));
    // Most plain segments are shared by no other pattern, so groups are only counted at first
    // (no member list per segment), and members are gathered for the large groups alone.
    let mut group_of: FxHashMap<Key<'t>, usize> =
        FxHashMap::with_capacity_and_hasher(texts.len() * 4, Default::default());
    let mut sizes: Vec<usize> = Vec::with_capacity(texts.len() * 4);
    let mut candidates: Vec<(usize, u32, &'t str)> = Vec::with_capacity(texts.len() * 4);
    let mut found = Vec::new();
    for (index, &text) in (0u32..).zip(texts) {
        // Hashing the text around each segment costs the text's length per segment: a text past
        // the limit is refused by its own compile, so it never drafts.
        if text.len() > MAX_PATTERN_CHARS && text.chars().count() > MAX_PATTERN_CHARS {
            continue;
        }
        plain_segments(text, &mut found);
        for (segment, range) in found.drain(..) {
            let around = (&text[..range.start], &text[range.end..]);
            let next = sizes.len();
            let group = *group_of.entry((segment, around)).or_insert(next);
            if group == next {
                sizes.push(0);
            }
            sizes[group] += 1;
            candidates.push((group, index, &text[range]));
        }
    }
    let mut large: Vec<(Key<'t>, usize)> = group_of
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
    let mut members: Vec<Vec<(u32, &'t str)>> = vec![Vec::new(); large.len()];
    for (group, index, literal) in candidates {
        if let Some(list) = members.get_mut(rank[group]) {
            list.push((index, literal));
        }
    }
    let mut joined = vec![false; texts.len()];
    let mut drafts = Vec::new();
    for (((segment, _), _), members) in large.into_iter().zip(members) {
        let free: Vec<_> = members
            .into_iter()
            .filter(|(index, _)| !joined[*index as usize])
            .collect();
        if free.len() < MIN_MEMBERS {
            continue;
        }
        for &(index, _) in &free {
            joined[index as usize] = true;
        }
        drafts.push(FamilyDraft {
            segment,
            members: free,
        });
    }
    drafts
}

impl Family {
    /// The family of `draft`, given its first member parsed; `None` where that glob does not hold
    /// the segment as one literal between dots (the members then stay separate patterns).
    pub fn new(draft: &FamilyDraft<'_>, first: &Pattern) -> Option<Family> {
        let glob = &first.glob;
        let node = if draft.segment == 0 {
            0
        } else {
            let mut dots = glob
                .iter()
                .enumerate()
                .filter(|(_, node)| matches!(node, Node::Dot { .. }));
            dots.nth(draft.segment - 1)?.0 + 1
        };
        let is_segment = matches!(glob.get(node), Some(Node::Literal(run)) if run == draft.members[0].1)
            && matches!(glob.get(node + 1), None | Some(Node::Dot { .. }));
        if !is_segment {
            return None;
        }
        let mut members: FxHashMap<String, Vec<u32>> =
            FxHashMap::with_capacity_and_hasher(draft.members.len(), Default::default());
        for &(index, literal) in &draft.members {
            members.entry(literal.to_owned()).or_default().push(index);
        }
        let mut literals: Vec<&String> = members.keys().collect();
        literals.sort_unstable();
        let alternation = Node::Alternation {
            position: 0,
            alternatives: literals
                .iter()
                .map(|literal| vec![Node::Literal(literal.to_string())])
                .collect(),
        };
        let mut family_glob = glob[..node].to_vec();
        family_glob.push(alternation);
        family_glob.extend_from_slice(&glob[node + 1..]);
        Some(Family {
            segment: draft.segment,
            hir: glob_hir(&family_glob),
            members,
        })
    }
}

/// The segments of a glob's text that are plain (every character literal anywhere in a glob)
/// and sit at a fixed position in every name it matches: segments before any brace or class
/// (which may hold dots), escape (which may be one) or `**` (which spans segments).
fn plain_segments(text: &str, found: &mut Vec<(usize, Range<usize>)>) {
    if text.starts_with(REGEX_PREFIX) {
        return;
    }
    let bytes = text.as_bytes();
    let (mut segment, mut start) = (0, 0);
    loop {
        let end = bytes[start..]
            .iter()
            .position(|&b| b == b'.')
            .map_or(bytes.len(), |dot| start + dot);
        let part = &text[start..end];
        if part.contains(['{', '[', '\\']) || part.contains("**") {
            return;
        }
        if !part.is_empty() && !part.chars().any(is_special) {
            found.push((segment, start..end));
        }
        if end == bytes.len() {
            return;
        }
        segment += 1;
        start = end + 1;
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
        draft_families(texts)
            .iter()
            .map(|draft| {
                let first = Pattern::compile(texts[draft.members[0].0 as usize]).unwrap();
                Family::new(draft, &first).expect("the first member holds the segment")
            })
            .collect()
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

    #[test]
    fn a_text_past_the_length_limit_drafts_no_family() {
        let long = "a.".repeat(MAX_PATTERN_CHARS);
        let texts: Vec<String> = (0..MIN_MEMBERS).map(|i| format!("{long}x{i}")).collect();
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        assert!(draft_families(&texts).is_empty());
        let short: Vec<String> = (0..MIN_MEMBERS).map(|i| format!("a.a.x{i}")).collect();
        let short: Vec<&str> = short.iter().map(String::as_str).collect();
        assert_eq!(draft_families(&short).len(), 1);
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
    fn only_plain_segments_vary() {
        // An escape, a metacharacter or a comma: the segment is not the same literal everywhere.
        for template in [r"a.#\*.b", "a.#*.b", "a.#?.b", "a.#,x.b", "a.<1-2>#.b"] {
            assert!(
                families_of(&each(template, &EIGHT)).is_empty(),
                "{template}"
            );
        }
        // After the segment, anything: the members share it.
        let found = families_of(&each(r"a.#.b\*.{c,d}", &EIGHT));
        assert_eq!(found.len(), 1);
        assert_eq!(members_of(&found[0], "a.c.b*.d"), &[2]);
        assert!(accepts(&found[0], "a.c.b*.d"));
        for name in ["a.c.bx.d", "a.x.b*.d", "a.c.b*.e"] {
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
