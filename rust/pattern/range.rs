//! A numeric range `<lo-hi>` as a regular expression over canonical decimal numerals
//! (no sign, no leading zeros, "0" itself allowed), so ranges run inside the one automaton.

use regex_syntax::hir::{Class, ClassUnicode, ClassUnicodeRange, Hir, Repetition};

/// A regex matching exactly the canonical numerals in `[lo, hi]`.
pub fn range_hir(lo: u64, hi: u64) -> Hir {
    debug_assert!(lo <= hi);
    let mut alternatives = Vec::new();
    let (lo_digits, hi_digits) = (digit_count(lo), digit_count(hi));
    for digits in lo_digits..=hi_digits {
        let smallest = if digits == 1 {
            0
        } else {
            10u64.pow(digits - 1)
        };
        let largest = 10u64.pow(digits) - 1;
        let from = lo.max(smallest).to_string();
        let to = hi.min(largest).to_string();
        alternatives.extend(same_length(from.as_bytes(), to.as_bytes()));
    }
    Hir::alternation(alternatives)
}

fn digit_count(value: u64) -> u32 {
    value.checked_ilog10().unwrap_or(0) + 1
}

/// Alternatives matching every numeral of `from.len()` digits between `from` and `to`.
fn same_length(from: &[u8], to: &[u8]) -> Vec<Hir> {
    let (first_lo, first_hi) = (from[0], to[0]);
    if from.len() == 1 {
        return vec![digit_class(first_lo, first_hi)];
    }
    let (rest_lo, rest_hi) = (&from[1..], &to[1..]);
    if first_lo == first_hi {
        return vec![then(first_lo, same_length(rest_lo, rest_hi))];
    }
    let all_nines = vec![b'9'; rest_lo.len()];
    let all_zeros = vec![b'0'; rest_lo.len()];
    let mut alternatives = Vec::new();
    let mut middle_lo = first_lo;
    if rest_lo != all_zeros.as_slice() {
        alternatives.push(then(first_lo, same_length(rest_lo, &all_nines)));
        middle_lo += 1;
    }
    let mut middle_hi = first_hi;
    let upper_edge = rest_hi != all_nines.as_slice();
    if upper_edge {
        middle_hi -= 1;
    }
    if middle_lo <= middle_hi {
        let count = rest_lo.len() as u32;
        let any_digits = Hir::repetition(Repetition {
            min: count,
            max: Some(count),
            greedy: true,
            sub: Box::new(digit_class(b'0', b'9')),
        });
        alternatives.push(Hir::concat(vec![
            digit_class(middle_lo, middle_hi),
            any_digits,
        ]));
    }
    if upper_edge {
        alternatives.push(then(first_hi, same_length(&all_zeros, rest_hi)));
    }
    alternatives
}

/// The digit `first`, then one of `rest`.
fn then(first: u8, rest: Vec<Hir>) -> Hir {
    Hir::concat(vec![Hir::literal([first]), Hir::alternation(rest)])
}

fn digit_class(lo: u8, hi: u8) -> Hir {
    if lo == hi {
        Hir::literal([lo])
    } else {
        let range = ClassUnicodeRange::new(lo as char, hi as char);
        Hir::class(Class::Unicode(ClassUnicode::new([range])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regex_automata::meta::Regex;

    fn accepts(lo: u64, hi: u64) -> Regex {
        let whole = Hir::concat(vec![
            Hir::look(regex_syntax::hir::Look::Start),
            range_hir(lo, hi),
            Hir::look(regex_syntax::hir::Look::End),
        ]);
        Regex::builder().build_from_hir(&whole).unwrap()
    }

    #[test]
    fn agrees_with_arithmetic_on_small_ranges() {
        for lo in 0..130u64 {
            for hi in (lo..1_100).step_by(37).chain([lo, lo + 1, 999, 1000]) {
                if hi < lo {
                    continue;
                }
                let re = accepts(lo, hi);
                for n in 0..1_200u64 {
                    assert_eq!(
                        re.is_match(&n.to_string()),
                        (lo..=hi).contains(&n),
                        "<{lo}-{hi}> on {n}"
                    );
                }
            }
        }
    }

    #[test]
    fn rejects_non_canonical_numerals() {
        let re = accepts(0, 127);
        for text in ["007", "00", "01", "+5", "-1", "", "1a", " 1"] {
            assert!(!re.is_match(text), "{text}");
        }
        assert!(re.is_match("0"));
    }

    #[test]
    fn handles_large_bounds() {
        let re = accepts(999_999_999_999_999_990, 999_999_999_999_999_999);
        assert!(re.is_match("999999999999999995"));
        assert!(!re.is_match("999999999999999989"));
    }
}
