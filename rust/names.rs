//! A compact table of FQNs: one string arena and end offsets, so a quarter of a million names
//! cost two allocations.

#[derive(Default, Debug, Clone)]
pub struct NameTable {
    text: String,
    ends: Vec<usize>,
}

impl NameTable {
    pub fn push(&mut self, name: &str) -> u32 {
        self.text.push_str(name);
        self.ends.push(self.text.len());
        (self.ends.len() - 1) as u32
    }

    pub fn get(&self, index: usize) -> &str {
        let start = if index == 0 { 0 } else { self.ends[index - 1] };
        &self.text[start..self.ends[index]]
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_names_back_to_back() {
        let mut table = NameTable::default();
        for name in ["", "a", "a.b", "ü"] {
            table.push(name);
        }
        assert_eq!(table.iter().collect::<Vec<_>>(), vec!["", "a", "a.b", "ü"]);
        assert_eq!(table.len(), 4);
    }
}
