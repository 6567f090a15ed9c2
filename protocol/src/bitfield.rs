//! A fixed-length set of chunk indices, packed most-significant bit first as it
//! travels in `Bitfield` and `BlobHolding` messages.

/// Which chunks of a blob are held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bitfield {
    len: u32,
    bits: Vec<u8>,
    ones: u32,
}

/// The wire bits do not fit the blob's chunk count.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "bitfield of {got} bytes does not fit {chunks} chunks (want {want} bytes, no bits past the end)"
)]
pub struct BitfieldError {
    pub got: usize,
    pub want: usize,
    pub chunks: u32,
}

impl Bitfield {
    pub fn new(len: u32) -> Self {
        Self {
            len,
            bits: vec![0; len.div_ceil(8) as usize],
            ones: 0,
        }
    }

    /// Every one of `len` chunks held.
    pub fn full(len: u32) -> Self {
        let mut bits = vec![0xff; len.div_ceil(8) as usize];
        if let Some(last) = bits.last_mut()
            && !len.is_multiple_of(8)
        {
            *last = !(0xffu8 >> (len % 8));
        }
        Self {
            len,
            bits,
            ones: len,
        }
    }

    /// Parses wire bits for a blob of `len` chunks; stray bits past the end are refused.
    pub fn from_bytes(len: u32, bits: &[u8]) -> Result<Self, BitfieldError> {
        let want = len.div_ceil(8) as usize;
        let err = BitfieldError {
            got: bits.len(),
            want,
            chunks: len,
        };
        if bits.len() != want {
            return Err(err);
        }
        if !len.is_multiple_of(8) && bits[want - 1] & (0xffu8 >> (len % 8)) != 0 {
            return Err(err);
        }
        let ones = bits.iter().map(|b| b.count_ones()).sum();
        Ok(Self {
            len,
            bits: bits.to_vec(),
            ones,
        })
    }

    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn count(&self) -> u32 {
        self.ones
    }

    pub fn is_full(&self) -> bool {
        self.ones == self.len
    }

    pub fn get(&self, i: u32) -> bool {
        let (byte, mask) = bit(i);
        i < self.len && self.bits[byte] & mask != 0
    }

    /// Sets bit `i`; returns whether it was newly set. Out-of-range is ignored.
    pub fn set(&mut self, i: u32) -> bool {
        if i >= self.len || self.get(i) {
            return false;
        }
        let (byte, mask) = bit(i);
        self.bits[byte] |= mask;
        self.ones += 1;
        true
    }

    /// Clears bit `i`; returns whether it was set.
    pub fn clear(&mut self, i: u32) -> bool {
        if !self.get(i) {
            return false;
        }
        let (byte, mask) = bit(i);
        self.bits[byte] &= !mask;
        self.ones -= 1;
        true
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bits
    }

    /// Indices of the chunks held, ascending.
    pub fn ones(&self) -> impl Iterator<Item = u32> + '_ {
        set_bits(self.bits.iter().copied())
    }

    /// The first missing chunk at or after `from`; `len()` if none is.
    pub fn next_zero(&self, from: u32) -> u32 {
        let start = (from / 8) as usize;
        // Bits below `from` in its byte count as set.
        let head = !(0xffu8 >> (from % 8));
        let found = self
            .bits
            .get(start..)
            .into_iter()
            .flatten()
            .enumerate()
            .find_map(|(k, &b)| {
                let b = if k == 0 { b | head } else { b };
                (b != 0xff).then(|| (start + k) as u32 * 8 + (!b).leading_zeros())
            });
        found.unwrap_or(self.len).min(self.len)
    }

    /// Whether this holds a chunk `other` lacks: at once if it holds more
    /// chunks, else compared a word at a time (the tracker asks this of
    /// every candidate peer it scores).
    pub fn has_any_missing_from(&self, other: &Bitfield) -> bool {
        if self.ones > other.ones {
            return true;
        }
        let (mut mine, mut theirs) = (self.bits.chunks_exact(8), other.bits.chunks_exact(8));
        let word = |b: &[u8]| u64::from_ne_bytes(b.try_into().expect("chunks of 8 bytes"));
        (mine.by_ref().zip(theirs.by_ref())).any(|(m, t)| word(m) & !word(t) != 0)
            || (mine.remainder().iter())
                .zip(theirs.remainder())
                .any(|(m, t)| m & !t != 0)
    }

    /// Indices of the chunks missing, ascending.
    pub fn zeros(&self) -> impl Iterator<Item = u32> + '_ {
        let len = self.len;
        set_bits(self.bits.iter().map(|&b| !b)).take_while(move |&i| i < len)
    }
}

/// The byte of a packed bitfield that holds bit `i`, and its mask.
pub(crate) fn bit(i: u32) -> (usize, u8) {
    ((i / 8) as usize, 0x80 >> (i % 8))
}

/// Indices of the bits set in `bytes` (packed as in a [`Bitfield`], most
/// significant bit first), skipping whole bytes with none set: chunk maps and
/// their combinations are mostly full or mostly empty, so this is far cheaper
/// than testing bit by bit.
pub(crate) fn set_bits(bytes: impl Iterator<Item = u8>) -> impl Iterator<Item = u32> {
    bytes.enumerate().flat_map(move |(i, b)| {
        let mut left = b;
        std::iter::from_fn(move || {
            (left != 0).then(|| {
                let bit = left.leading_zeros();
                left &= !(0x80 >> bit);
                i as u32 * 8 + bit
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_holds_every_chunk_and_reads_back_from_its_wire_bits() {
        for len in [0, 1, 7, 8, 9, 17] {
            let f = Bitfield::full(len);
            assert!(f.is_full());
            assert_eq!(f.ones().count() as u32, len);
            assert_eq!(Bitfield::from_bytes(len, f.as_bytes()).unwrap(), f);
        }
    }

    #[test]
    fn next_zero_finds_the_first_clear_bit_from_any_start() {
        for len in [0u32, 1, 7, 8, 9, 63, 64, 65, 641] {
            let mut b = Bitfield::new(len);
            for i in (0..len).filter(|i| i % 5 != 4 && i % 11 != 3) {
                b.set(i);
            }
            for from in 0..=len + 9 {
                let want = b.zeros().find(|&i| i >= from).unwrap_or(len);
                assert_eq!(b.next_zero(from), want, "len {len} from {from}");
            }
        }
    }

    #[test]
    fn finds_a_chunk_missing_from_another_at_any_position() {
        for len in [1, 8, 63, 64, 70, 640] {
            let full = Bitfield::from_bytes(len, &{
                let mut f = Bitfield::new(len);
                (0..len).for_each(|i| _ = f.set(i));
                f.bits
            })
            .unwrap();
            assert!(!Bitfield::new(len).has_any_missing_from(&Bitfield::new(len)));
            for i in 0..len {
                let mut one = Bitfield::new(len);
                one.set(i);
                let mut all_but = full.clone();
                all_but.clear(i);
                assert!(one.has_any_missing_from(&Bitfield::new(len)), "{len} {i}");
                assert!(one.has_any_missing_from(&all_but), "{len} {i}");
                assert!(!one.has_any_missing_from(&one), "{len} {i}");
                assert!(!all_but.has_any_missing_from(&full), "{len} {i}");
            }
        }
    }

    #[test]
    fn ones_and_zeros_list_exactly_the_set_and_clear_bits() {
        for len in [0u32, 1, 7, 8, 9, 63, 64, 65, 640, 641] {
            let mut b = Bitfield::new(len);
            for i in (0..len).filter(|i| i % 3 == 0 || i % 7 == 1) {
                b.set(i);
            }
            let ones: Vec<u32> = (0..len).filter(|&i| b.get(i)).collect();
            let zeros: Vec<u32> = (0..len).filter(|&i| !b.get(i)).collect();
            assert_eq!(b.ones().collect::<Vec<_>>(), ones, "len {len}");
            assert_eq!(b.zeros().collect::<Vec<_>>(), zeros, "len {len}");
        }
    }

    #[test]
    fn set_clear_and_wire_round_trip() {
        let mut b = Bitfield::new(11);
        assert!(b.set(0) && b.set(10) && !b.set(10) && !b.set(11));
        assert_eq!(b.count(), 2);
        let again = Bitfield::from_bytes(11, b.as_bytes()).unwrap();
        assert_eq!(again, b);
        let mut again = again;
        assert!(again.clear(0) && !again.clear(0));
        assert_eq!(b.ones().collect::<Vec<_>>(), vec![0, 10]);
    }

    #[test]
    fn refuses_stray_bits_and_wrong_lengths() {
        assert!(Bitfield::from_bytes(11, &[0, 0b0001_0000]).is_err());
        assert!(Bitfield::from_bytes(11, &[0]).is_err());
        assert!(Bitfield::from_bytes(11, &[0xff, 0b1110_0000]).is_ok());
    }
}
