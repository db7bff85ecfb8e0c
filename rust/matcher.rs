//! Many patterns compiled once and answered together (`PatternSet`).
//!
//! A set of exact FQNs only is answered by one hash lookup per name. Otherwise every pattern,
//! exact ones included, joins one lazy DFA (`MatchKind::All`, so one pass reports every pattern
//! that matches): once the DFA runs anyway, a literal costs it nothing per name, while a hash
//! lookup would hash the whole name again. Patterns that differ in one literal segment only (a
//! generated plan's one pattern per layer) join it as one family pattern (see `families`). The
//! DFA is also stepped segment by segment by the tree walk, whose pruning is "the DFA is dead
//! and no exact FQN lies below". `re:` patterns with Unicode word boundaries, which the DFA
//! cannot run, are asked of one meta regex per name and disable pruning.

use std::sync::Mutex;

use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::hybrid::LazyStateID;
use regex_automata::meta;
use regex_automata::nfa::thompson;
use regex_automata::util::start;
use regex_automata::{Anchored, Input, MatchKind, PatternSet as MatchSet};
use rustc_hash::{FxHashMap, FxHashSet};

use crate::families::{draft_families, Family, RecentMembers};
use crate::pattern::{Pattern, PatternError, Strategy};

/// The lazy DFA's cache budget: large enough that big generated plans rarely clear it.
const DFA_CACHE_BYTES: usize = 64 << 20;

#[derive(Debug)]
pub enum MatchError {
    /// The automaton could not be built (size limits) or could not answer.
    Automaton(String),
}

impl std::fmt::Display for MatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MatchError::Automaton(reason) => write!(f, "pattern automaton failed: {reason}"),
        }
    }
}

pub enum BuildError {
    Pattern(PatternError),
    Matcher(MatchError),
}

/// The lazy DFA and what a match of each of its patterns means.
struct Automaton {
    dfa: DFA,
    answers: Vec<Answer>,
    families: Vec<Family>,
}

enum Answer {
    /// One pattern of the set (its index).
    Pattern(u32),
    /// Patterns the same but for one literal segment, which tells them apart (the family's
    /// position in `Automaton::families`).
    Family(usize),
}

struct Fallback {
    regex: meta::Regex,
    pattern_ids: Vec<u32>,
}

pub struct PatternSet {
    /// The patterns as written.
    pub texts: Vec<String>,
    exact: FxHashMap<String, Vec<u32>>,
    /// Every proper dotted prefix of an exact FQN: the walk must enter these.
    exact_prefixes: FxHashSet<String>,
    root_matches: Vec<u32>,
    automaton: Option<Automaton>,
    fallback: Option<Fallback>,
    cache: Mutex<Option<Cache>>,
}

/// Where the DFA stands after a prefix of a name (`None` when the set has no automaton).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DfaState {
    id: LazyStateID,
    clear_count: usize,
}

impl PatternSet {
    pub fn new<S: AsRef<str>>(texts: &[S]) -> Result<PatternSet, BuildError> {
        let texts: Vec<&str> = texts.iter().map(AsRef::as_ref).collect();
        let drafts = draft_families(&texts);
        // A family's members after its first are parsed only if the family does not form.
        let mut parsed_later = vec![false; texts.len()];
        for draft in &drafts {
            for &(index, _) in &draft.members[1..] {
                parsed_later[index as usize] = true;
            }
        }
        let compile = |text: &str| Pattern::compile(text).map_err(BuildError::Pattern);
        let mut patterns: Vec<Option<Pattern>> = texts
            .iter()
            .zip(&parsed_later)
            .map(|(text, &later)| (!later).then(|| compile(text)).transpose())
            .collect::<Result<_, _>>()?;
        // Exact FQNs alone are answered by hash lookups: families only join a DFA.
        let needs_automaton = patterns
            .iter()
            .flatten()
            .any(|p| matches!(p.strategy, Strategy::Glob | Strategy::Regex(_)));
        let mut families = Vec::new();
        let mut in_family = vec![false; texts.len()];
        for draft in &drafts {
            let first = draft.members[0].0 as usize;
            let family = patterns[first]
                .as_ref()
                .filter(|_| needs_automaton)
                .and_then(|pattern| Family::new(draft, pattern));
            if let Some(family) = family {
                families.push(family);
                for &(index, _) in &draft.members {
                    in_family[index as usize] = true;
                }
            } else {
                for &(index, _) in &draft.members[1..] {
                    patterns[index as usize] = Some(compile(texts[index as usize])?);
                }
            }
        }
        let mut exact: FxHashMap<String, Vec<u32>> = FxHashMap::default();
        let mut exact_prefixes = FxHashSet::default();
        let mut root_matches = Vec::new();
        let (mut dfa_regexes, mut dfa_answers) = (Vec::new(), Vec::new());
        let (mut fallback_regexes, mut fallback_ids) = (Vec::new(), Vec::new());
        for (index, pattern) in patterns.iter().enumerate() {
            let Some(pattern) = pattern.as_ref().filter(|_| !in_family[index]) else {
                continue;
            };
            let index32 = index as u32;
            if pattern.matches_root {
                root_matches.push(index32);
            }
            match &pattern.strategy {
                Strategy::Root => {}
                Strategy::Exact(_) if needs_automaton => {
                    dfa_regexes.extend(pattern.hir());
                    dfa_answers.push(Answer::Pattern(index32));
                }
                Strategy::Exact(name) => {
                    exact.entry(name.clone()).or_default().push(index32);
                    for (dot, _) in name.match_indices('.') {
                        exact_prefixes.insert(name[..dot].to_owned());
                    }
                }
                Strategy::Glob | Strategy::Regex(_) => {
                    dfa_regexes.extend(pattern.hir());
                    dfa_answers.push(Answer::Pattern(index32));
                }
                Strategy::Fallback(hir) => {
                    fallback_regexes.push(hir);
                    fallback_ids.push(index32);
                }
            }
        }
        dfa_regexes.extend(families.iter().map(|family| family.hir.clone()));
        let automaton = if dfa_regexes.is_empty() {
            None
        } else {
            let nfa = thompson::Compiler::new()
                .configure(
                    thompson::Config::new()
                        .nfa_size_limit(None)
                        // A DFA reports no captures.
                        .which_captures(thompson::WhichCaptures::None),
                )
                .build_many_from_hir(&dfa_regexes)
                .map_err(|e| BuildError::Matcher(automaton_error(e)))?;
            let dfa = DFA::builder()
                .configure(
                    DFA::config()
                        .match_kind(MatchKind::All)
                        .cache_capacity(DFA_CACHE_BYTES)
                        .skip_cache_capacity_check(true)
                        .minimum_cache_clear_count(None),
                )
                .build_from_nfa(nfa)
                .map_err(|e| BuildError::Matcher(automaton_error(e)))?;
            dfa_answers.extend((0..families.len()).map(Answer::Family));
            Some(Automaton {
                dfa,
                answers: dfa_answers,
                families,
            })
        };
        let fallback = if fallback_regexes.is_empty() {
            None
        } else {
            let regex = meta::Regex::builder()
                .configure(
                    meta::Regex::config()
                        .match_kind(MatchKind::All)
                        .nfa_size_limit(None),
                )
                .build_many_from_hir(&fallback_regexes)
                .map_err(|e| BuildError::Matcher(automaton_error(e)))?;
            Some(Fallback {
                regex,
                pattern_ids: fallback_ids,
            })
        };
        let cache = Mutex::new(automaton.as_ref().map(|a| a.dfa.create_cache()));
        Ok(PatternSet {
            texts: texts.into_iter().map(str::to_owned).collect(),
            exact,
            exact_prefixes,
            root_matches,
            automaton,
            fallback,
            cache,
        })
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    /// Whether a subtree can be skipped when its FQN leaves the DFA dead: only without fallbacks.
    pub fn can_prune(&self) -> bool {
        self.fallback.is_none()
    }

    /// Runs `f` with a matcher that owns the DFA cache for its duration.
    pub fn with_matcher<R>(&self, f: impl FnOnce(&mut Matcher<'_>) -> R) -> R {
        let mut guard = self
            .cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut self.matcher(guard.as_mut()))
    }

    /// Runs `f` with a matcher on a DFA cache of its own: for another thread, while the set's
    /// own cache serves this one.
    pub fn with_new_matcher<R>(&self, f: impl FnOnce(&mut Matcher<'_>) -> R) -> R {
        let mut cache = self.automaton.as_ref().map(|a| a.dfa.create_cache());
        f(&mut self.matcher(cache.as_mut()))
    }

    fn matcher<'a>(&'a self, cache: Option<&'a mut Cache>) -> Matcher<'a> {
        let fallback_hits =
            MatchSet::new(self.fallback.as_ref().map_or(0, |f| f.regex.pattern_len()));
        let recent_members =
            RecentMembers::new(self.automaton.as_ref().map_or(0, |a| a.families.len()));
        Matcher {
            set: self,
            dfa: self.automaton.as_ref().zip(cache),
            fallback_hits,
            recent_members,
        }
    }
}

/// A `PatternSet` with its DFA cache, ready to answer names or step through them.
pub struct Matcher<'a> {
    set: &'a PatternSet,
    dfa: Option<(&'a Automaton, &'a mut Cache)>,
    fallback_hits: MatchSet,
    recent_members: RecentMembers<'a>,
}

fn automaton_error(e: impl std::fmt::Display) -> MatchError {
    MatchError::Automaton(e.to_string())
}

impl Matcher<'_> {
    /// Appends to `out` the ascending indices of the patterns matching `name`.
    pub fn match_name(&mut self, name: &str, out: &mut Vec<u32>) -> Result<(), MatchError> {
        let start = self.start()?;
        let state = self.advance(start, name.as_bytes())?;
        self.finish(name, state, out)
    }

    /// The state at the start of a name (the root's state in a walk).
    pub fn start(&mut self) -> Result<Option<DfaState>, MatchError> {
        let Some((automaton, cache)) = &mut self.dfa else {
            return Ok(None);
        };
        let config = start::Config::new().anchored(Anchored::Yes);
        let id = automaton
            .dfa
            .start_state(cache, &config)
            .map_err(automaton_error)?;
        Ok(Some(DfaState {
            id,
            clear_count: cache.clear_count(),
        }))
    }

    /// Feeds `bytes` after `state`.
    pub fn advance(
        &mut self,
        state: Option<DfaState>,
        bytes: &[u8],
    ) -> Result<Option<DfaState>, MatchError> {
        self.advance_segments(state, bytes, |_, _| {})
    }

    /// The states after a child's `name` (from its parent's `state`) and after it and a `.`,
    /// where the child's own children would start.
    pub fn advance_name(
        &mut self,
        state: Option<DfaState>,
        name: &[u8],
    ) -> Result<(Option<DfaState>, Option<DfaState>), MatchError> {
        let after = self.advance(state, name)?;
        Ok((after, self.advance(after, b".")?))
    }

    /// Feeds `bytes` after `state`, telling `after_dot` the offset just after each `.` and the
    /// state there (a dead state stays dead, so the dots past it are found without the DFA).
    pub fn advance_segments(
        &mut self,
        state: Option<DfaState>,
        bytes: &[u8],
        mut after_dot: impl FnMut(usize, Option<DfaState>),
    ) -> Result<Option<DfaState>, MatchError> {
        let (Some((automaton, cache)), Some(state)) = (&mut self.dfa, state) else {
            return Ok(None);
        };
        let dfa = &automaton.dfa;
        let mut id = state.id;
        for (offset, &byte) in bytes.iter().enumerate() {
            if !id.is_tagged() {
                // The common case: a cached transition out of an ordinary state.
                let next = dfa.next_state_untagged(cache, id, byte);
                id = if next.is_unknown() {
                    dfa.next_state(cache, id, byte).map_err(automaton_error)?
                } else {
                    next
                };
            } else if id.is_dead() {
                let state = Some(DfaState {
                    id,
                    clear_count: cache.clear_count(),
                });
                for (rest, &byte) in bytes.iter().enumerate().skip(offset) {
                    if byte == b'.' {
                        after_dot(rest + 1, state);
                    }
                }
                return Ok(state);
            } else {
                id = dfa.next_state(cache, id, byte).map_err(automaton_error)?;
            }
            if byte == b'.' {
                after_dot(
                    offset + 1,
                    Some(DfaState {
                        id,
                        clear_count: cache.clear_count(),
                    }),
                );
            }
        }
        Ok(Some(DfaState {
            id,
            clear_count: cache.clear_count(),
        }))
    }

    /// Whether a state saved earlier is still valid (a cache clear invalidates every state id).
    pub fn is_current(&self, state: Option<DfaState>) -> bool {
        match (&self.dfa, state) {
            (Some((_, cache)), Some(s)) => s.clear_count == cache.clear_count(),
            _ => true,
        }
    }

    /// Whether some pattern can match `name` itself (`below == false`, `state` after `name`) or
    /// a name under it (`below == true`, `state` after `name` and one more `.`).
    pub fn may_reach(&self, name: &str, state: Option<DfaState>, below: bool) -> bool {
        if !self.set.can_prune() || state.is_some_and(|s| !s.id.is_dead()) {
            return true;
        }
        if below {
            !self.set.exact_prefixes.is_empty() && self.set.exact_prefixes.contains(name)
        } else {
            !self.set.exact.is_empty() && self.set.exact.contains_key(name)
        }
    }

    /// The patterns matching the whole `name`, given the DFA state after all of it.
    pub fn finish(
        &mut self,
        name: &str,
        state: Option<DfaState>,
        out: &mut Vec<u32>,
    ) -> Result<(), MatchError> {
        let before = out.len();
        if name.is_empty() {
            out.extend_from_slice(&self.set.root_matches);
            return Ok(());
        }
        if !self.set.exact.is_empty() {
            if let Some(ids) = self.set.exact.get(name) {
                out.extend_from_slice(ids);
            }
        }
        if let (Some((automaton, cache)), Some(state)) = (&mut self.dfa, state) {
            if !state.id.is_dead() {
                let end = automaton
                    .dfa
                    .next_eoi_state(cache, state.id)
                    .map_err(automaton_error)?;
                if end.is_match() {
                    for k in 0..automaton.dfa.match_len(cache, end) {
                        let matched = automaton.dfa.match_pattern(cache, end, k).as_usize();
                        match &automaton.answers[matched] {
                            Answer::Pattern(index) => out.push(*index),
                            Answer::Family(which) => {
                                match self.recent_members.members_of(
                                    &automaton.families,
                                    *which,
                                    name,
                                ) {
                                    // Nearly always one pattern: a push, not a call to memcpy.
                                    &[member] => out.push(member),
                                    members => out.extend_from_slice(members),
                                }
                            }
                        }
                    }
                }
            }
        }
        if let Some(fallback) = &self.set.fallback {
            self.fallback_hits.clear();
            fallback.regex.which_overlapping_matches(
                &Input::new(name).anchored(Anchored::Yes),
                &mut self.fallback_hits,
            );
            out.extend(
                self.fallback_hits
                    .iter()
                    .map(|p| fallback.pattern_ids[p.as_usize()]),
            );
        }
        if out.len() - before > 1 {
            out[before..].sort_unstable();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(patterns: &[&str], name: &str) -> Vec<u32> {
        let set = PatternSet::new(patterns).ok().expect("compiles");
        let mut out = Vec::new();
        set.with_matcher(|m| m.match_name(name, &mut out)).unwrap();
        out
    }

    #[test]
    fn mixes_strategies_in_ascending_order() {
        let patterns = ["re:\\bx.*", "a.*", "a.b", "**", "", "a.{b,c}", "re:a\\.b"];
        assert_eq!(matches(&patterns, "a.b"), vec![1, 2, 3, 5, 6]);
        assert_eq!(matches(&patterns, ""), vec![3, 4]);
        assert_eq!(matches(&patterns, "x.y"), vec![0, 3]);
    }

    #[test]
    fn families_answer_each_member_with_the_other_patterns_in_order() {
        let mut patterns: Vec<String> = (0..12).map(|l| format!("layers.{l}.mlp.gate")).collect();
        patterns.insert(3, "layers.*.mlp.gate".to_owned());
        patterns.push("layers.5.mlp.gate".to_owned());
        let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
        assert_eq!(matches(&patterns, "layers.5.mlp.gate"), vec![3, 6, 13]);
        assert_eq!(matches(&patterns, "layers.11.mlp.gate"), vec![3, 12]);
        assert_eq!(matches(&patterns, "layers.12.mlp.gate"), vec![3]);
        assert!(matches(&patterns, "layers.5.mlp").is_empty());
    }

    fn layer_texts(template: &str) -> Vec<String> {
        (0..12)
            .map(|l| template.replace('#', &l.to_string()))
            .collect()
    }

    #[test]
    fn exact_fqns_shaped_like_a_family_stay_hash_lookups() {
        let texts = layer_texts("layers.#.mlp.gate");
        let set = PatternSet::new(&texts).ok().unwrap();
        assert!(set.automaton.is_none());
        let mut out = Vec::new();
        set.with_matcher(|m| m.match_name("layers.7.mlp.gate", &mut out))
            .unwrap();
        assert_eq!(out, vec![7]);
    }

    #[test]
    fn a_malformed_family_reports_its_first_member_after_earlier_patterns() {
        let error_of = |texts: &[String]| match PatternSet::new(texts) {
            Err(BuildError::Pattern(e)) => e.pattern,
            _ => panic!("{texts:?} must not compile"),
        };
        let mut texts = layer_texts("layers.#.mlp[");
        assert_eq!(error_of(&texts), "layers.0.mlp[");
        texts.insert(0, "x{".to_owned());
        assert_eq!(error_of(&texts), "x{");
    }

    #[test]
    fn numeric_ranges_and_unicode() {
        assert_eq!(matches(&["layers.<0-15>.mlp"], "layers.15.mlp"), vec![0]);
        assert!(matches(&["layers.<0-15>.mlp"], "layers.16.mlp").is_empty());
        assert!(matches(&["layers.<0-15>.mlp"], "layers.01.mlp").is_empty());
        assert_eq!(matches(&["blöck.?"], "blöck.ü"), vec![0]);
    }

    #[test]
    fn pruning_knows_exact_prefixes() {
        let set = PatternSet::new(&["a.b.c", "x.*"]).ok().unwrap();
        set.with_matcher(|m| {
            let start = m.start().unwrap();
            let a = m.advance(start, b"a.").unwrap();
            assert!(m.may_reach("a", a, true));
            let q = m.advance(start, b"q.").unwrap();
            assert!(!m.may_reach("q", q, true));
            let x = m.advance(start, b"x.y").unwrap();
            assert!(m.may_reach("x.y", x, false));
        });
    }

    #[test]
    fn survives_cache_pressure_with_many_patterns() {
        // Two segments vary, so the patterns form no family: 2000 DFA patterns.
        let patterns: Vec<String> = (0..2000).map(|i| format!("layers.{i}.*.w{i}")).collect();
        let set = PatternSet::new(&patterns).ok().unwrap();
        let mut out = Vec::new();
        set.with_matcher(|m| m.match_name("layers.1999.mlp.w1999", &mut out))
            .unwrap();
        assert_eq!(out, vec![1999]);
    }
}
