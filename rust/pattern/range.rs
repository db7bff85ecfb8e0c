//! A numeric range `<lo-hi>` as a regular expression over canonical decimal numerals
//! (no sign, no leading zeros, "0" itself allowed), so ranges run inside the one automaton.

/// A regex (a non-capturing group) matching exactly the canonical numerals in `[lo, hi]`.
pub fn range_regex(lo: u64, hi: u64) -> String {
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
    format!("(?:{})", alternatives.join("|"))
}

fn digit_count(value: u64) -> u32 {
    value.checked_ilog10().unwrap_or(0) + 1
}

/// Alternatives matching every numeral of `from.len()` digits between `from` and `to`.
fn same_length(from: &[u8], to: &[u8]) -> Vec<String> {
    let (first_lo, first_hi) = (from[0], to[0]);
    if from.len() == 1 {
        return vec![digit_class(first_lo, first_hi)];
    }
    let (rest_lo, rest_hi) = (&from[1..], &to[1..]);
    if first_lo == first_hi {
        return vec![format!(
            "{}{}",
            first_lo as char,
            group(same_length(rest_lo, rest_hi))
        )];
    }
    let all_nines = vec![b'9'; rest_lo.len()];
    let all_zeros = vec![b'0'; rest_lo.len()];
    let mut alternatives = Vec::new();
    let mut middle_lo = first_lo;
    if rest_lo != all_zeros.as_slice() {
        alternatives.push(format!(
            "{}{}",
            first_lo as char,
            group(same_length(rest_lo, &all_nines))
        ));
        middle_lo += 1;
    }
    let mut middle_hi = first_hi;
    let upper_edge = rest_hi != all_nines.as_slice();
    if upper_edge {
        middle_hi -= 1;
    }
    if middle_lo <= middle_hi {
        alternatives.push(format!(
            "{}[0-9]{{{}}}",
            digit_class(middle_lo, middle_hi),
            rest_lo.len()
        ));
    }
    if upper_edge {
        alternatives.push(format!(
            "{}{}",
            first_hi as char,
            group(same_length(&all_zeros, rest_hi))
        ));
    }
    alternatives
}

fn digit_class(lo: u8, hi: u8) -> String {
    if lo == hi {
        (lo as char).to_string()
    } else {
        format!("[{}-{}]", lo as char, hi as char)
    }
}

fn group(alternatives: Vec<String>) -> String {
    if alternatives.len() == 1 {
        alternatives.into_iter().next().unwrap_or_default()
    } else {
        format!("(?:{})", alternatives.join("|"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regex_automata::meta::Regex;

    fn accepts(lo: u64, hi: u64) -> Regex {
        Regex::new(&format!("^{}$", range_regex(lo, hi))).unwrap()
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
