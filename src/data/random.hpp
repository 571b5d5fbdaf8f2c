// Counter-based randomness and content hashing for the data path.
//
// Design choice: nothing in the data path keeps RNG state. Every random decision is a pure
// function of a key (seed, epoch, sequence index, position, purpose), so the same decision is
// made on any rank, at any rank count, after any resume. The mixer is SplitMix64's finaliser
// applied to a running combination of the key words; it passes the usual avalanche tests and
// costs a few multiplies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace plm::data::random {

/// \brief SplitMix64 finaliser: a bijective 64-bit mixer.
inline std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// \brief A 64-bit random word keyed by up to five counters.
inline std::uint64_t keyed(std::uint64_t a, std::uint64_t b = 0, std::uint64_t c = 0,
                           std::uint64_t d = 0, std::uint64_t e = 0) {
  std::uint64_t h = mix64(a);
  h = mix64(h ^ b);
  h = mix64(h ^ c);
  h = mix64(h ^ d);
  return mix64(h ^ e);
}

/// \brief A double in [0, 1) from a random word (53 high bits).
inline double unit(std::uint64_t word) { return double(word >> 11) * 0x1.0p-53; }

/// \brief A value in [0, n) from a random word (multiply-shift, bias < n / 2^64).
inline std::uint64_t below(std::uint64_t word, std::uint64_t n) {
  return std::uint64_t((static_cast<unsigned __int128>(word) * n) >> 64);
}

/// Purposes, so that draws for different decisions never share a key.
enum Purpose : std::uint64_t {
  permute = 1,
  crop = 2,
  select = 3,
  corrupt = 4,
  replace = 5,
  split = 6
};

/// \brief 128-bit content hash of a byte string ("plm-hash128 v1", doc/data.md): two 64-bit
/// lanes absorb the bytes in 8-byte little-endian words (the tail zero-padded) with different
/// seeds, each step h = mix64(h ^ word) (lane 2 rotates the word first); both lanes then absorb
/// the length. Used for duplicate detection and the train/valid split.
struct Hash128 {
  std::uint64_t lo = 0, hi = 0;
  bool operator==(const Hash128& o) const { return lo == o.lo && hi == o.hi; }
  bool operator<(const Hash128& o) const { return hi != o.hi ? hi < o.hi : lo < o.lo; }
};

inline Hash128 contentHash(const std::uint8_t* bytes, std::size_t n) {
  std::uint64_t a = 0x243f6a8885a308d3ull, b = 0x13198a2e03707344ull;
  std::size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    std::uint64_t w;
    std::memcpy(&w, bytes + k, 8);
    a = mix64(a ^ w);
    b = mix64(b ^ ((w << 29) | (w >> 35)));
  }
  if (k < n) {
    std::uint64_t w = 0;
    std::memcpy(&w, bytes + k, n - k);
    a = mix64(a ^ w);
    b = mix64(b ^ ((w << 29) | (w >> 35)));
  }
  return {mix64(a ^ n), mix64(b ^ ~std::uint64_t(n))};
}

/// \brief The split rule: a sequence goes to validation iff this is < fraction.
inline double splitDraw(const Hash128& h) { return unit(keyed(h.lo, h.hi, split)); }

}  // namespace plm::data::random
