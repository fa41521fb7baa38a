// Generates kernels/codebooks.inc: Lloyd-Max codebooks for the coordinates of a
// randomly rotated, normalized block (docs/ARCHITECTURE.md, "The method").
//
// After a random rotation a block of B values, scaled to norm sqrt(B), is a
// uniform point on the sphere of radius sqrt(B). One coordinate t then has the
// density f(t) = (1 - t^2/B)^((B-3)/2) / Z on [-sqrt(B), sqrt(B)]; its variance
// is exactly 1. For each B in {64, 128} and b in {2, 3, 4} bits this program
// runs Lloyd's algorithm on that density (boundaries at midpoints, centroids at
// conditional means) to convergence and prints the centroids, the decision
// boundaries and the resulting mean squared error per coordinate.
//
// Usage: codebook_gen [OUTPUT]   (stdout when no OUTPUT is given)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

using Real = long double;

// Cumulative integrals of f, t*f and t^2*f (unnormalized) over [-sqrt(B), x],
// tabulated on a fine grid and completed with Gauss-Legendre on the last piece.
class Moments {
 public:
  explicit Moments(int block) : block_(block), a_((block - 3) / 2.0L) {
    lo_ = -std::sqrt(static_cast<Real>(block));
    step_ = -2 * lo_ / kCells;
    f0_.assign(kCells + 1, 0);
    f2_.assign(kCells + 1, 0);
    for (int i = 0; i < kCells; ++i) {
      Real m0, m2;
      Piece(lo_ + i * step_, lo_ + (i + 1) * step_, &m0, &m2);
      f0_[i + 1] = f0_[i] + m0;
      f2_[i + 1] = f2_[i] + m2;
    }
  }

  Real hi() const { return -lo_; }
  Real Total() const { return f0_[kCells]; }

  // Integrals of f and t^2 f over [lo, x].
  void Cumulative(Real x, Real* m0, Real* m2) const {
    if (x <= lo_) {
      *m0 = *m2 = 0;
      return;
    }
    if (x >= -lo_) {
      *m0 = f0_[kCells];
      *m2 = f2_[kCells];
      return;
    }
    int cell = static_cast<int>((x - lo_) / step_);
    if (cell >= kCells) cell = kCells - 1;
    Real p0, p2;
    Piece(lo_ + cell * step_, x, &p0, &p2);
    *m0 = f0_[cell] + p0;
    *m2 = f2_[cell] + p2;
  }

  // Integral of t f over [lo, x], in closed form.
  Real FirstMoment(Real x) const {
    const Real b = static_cast<Real>(block_);
    auto antiderivative = [&](Real t) {
      const Real base = 1 - t * t / b;
      return base <= 0 ? Real(0) : -b / (2 * (a_ + 1)) * std::pow(base, a_ + 1);
    };
    if (x >= -lo_) return 0;
    return antiderivative(x) - antiderivative(lo_);
  }

 private:
  static constexpr int kCells = 1 << 18;

  Real Density(Real t) const {
    const Real base = 1 - t * t / block_;
    return base <= 0 ? Real(0) : std::pow(base, a_);
  }

  // 5-point Gauss-Legendre on [x0, x1] for f and t^2 f.
  void Piece(Real x0, Real x1, Real* m0, Real* m2) const {
    static const Real kNodes[5] = {0.0L, -0.5384693101056830910363144L,
                                   0.5384693101056830910363144L,
                                   -0.9061798459386639927976269L,
                                   0.9061798459386639927976269L};
    static const Real kWeights[5] = {
        0.5688888888888888888888889L, 0.4786286704993664680412915L,
        0.4786286704993664680412915L, 0.2369268850561890875142640L,
        0.2369268850561890875142640L};
    const Real mid = (x0 + x1) / 2, half = (x1 - x0) / 2;
    Real s0 = 0, s2 = 0;
    for (int k = 0; k < 5; ++k) {
      const Real t = mid + half * kNodes[k];
      const Real w = kWeights[k] * Density(t);
      s0 += w;
      s2 += w * t * t;
    }
    *m0 = s0 * half;
    *m2 = s2 * half;
  }

  int block_;
  Real a_;
  Real lo_;
  Real step_;
  std::vector<Real> f0_, f2_;
};

struct Codebook {
  std::vector<Real> centroids;
  std::vector<Real> boundaries;
  Real mse;
};

// Integrals of f, t f and t^2 f over the cell of centroid i.
struct Cell {
  Real mass, first, second;
};

Cell CellMoments(const Moments& m, const Codebook& cb, int i) {
  const int levels = static_cast<int>(cb.centroids.size());
  const Real lo = i == 0 ? -m.hi() : cb.boundaries[i - 1];
  const Real hi = i + 1 == levels ? m.hi() : cb.boundaries[i];
  Real a0, a2, b0, b2;
  m.Cumulative(lo, &a0, &a2);
  m.Cumulative(hi, &b0, &b2);
  return Cell{b0 - a0, m.FirstMoment(hi) - m.FirstMoment(lo), b2 - a2};
}

void SetMidpoints(Codebook* cb) {
  for (size_t i = 0; i + 1 < cb->centroids.size(); ++i) {
    cb->boundaries[i] = (cb->centroids[i] + cb->centroids[i + 1]) / 2;
  }
}

Codebook LloydMax(const Moments& m, int bits) {
  const int levels = 1 << bits;
  Codebook cb;
  cb.centroids.resize(levels);
  // Start from evenly spaced levels over +-2.5 standard deviations.
  for (int i = 0; i < levels; ++i) cb.centroids[i] = -2.5L + 5.0L * (i + 0.5L) / levels;
  cb.boundaries.resize(levels - 1);
  for (int iter = 0; iter < 200000; ++iter) {
    SetMidpoints(&cb);
    Real change = 0;
    for (int i = 0; i < levels; ++i) {
      const Cell cell = CellMoments(m, cb, i);
      const Real mean = cell.first / cell.mass;
      change = std::fmax(change, std::fabs(mean - cb.centroids[i]));
      cb.centroids[i] = mean;
    }
    if (change < 1e-15L) break;
  }
  // Enforce exact symmetry, then recompute the boundaries and the error.
  for (int i = 0; i < levels / 2; ++i) {
    const Real c = (cb.centroids[levels - 1 - i] - cb.centroids[i]) / 2;
    cb.centroids[i] = -c;
    cb.centroids[levels - 1 - i] = c;
  }
  SetMidpoints(&cb);
  Real err = 0;
  for (int i = 0; i < levels; ++i) {
    const Cell cell = CellMoments(m, cb, i);
    const Real c = cb.centroids[i];
    err += cell.second - 2 * c * cell.first + c * c * cell.mass;
  }
  cb.mse = err / m.Total();
  return cb;
}

// Prints a float literal that C++ and CUDA parse back to the same float.
void PrintFloat(FILE* out, const char* separator, Real v) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.9g", static_cast<double>(static_cast<float>(v)));
  const bool integral = std::strpbrk(text, ".e") == nullptr;
  std::fprintf(out, "%s%s%sf", separator, text, integral ? ".0" : "");
}

}  // namespace

int main(int argc, char** argv) {
  FILE* out = stdout;
  if (argc > 2) {
    std::fprintf(stderr, "usage: %s [OUTPUT]\n", argv[0]);
    return 2;
  }
  if (argc == 2) {
    out = std::fopen(argv[1], "w");
    if (out == nullptr) {
      std::perror(argv[1]);
      return 1;
    }
  }
  std::fprintf(out,
               "// Generated by tools/codebook_gen.cc; do not edit. A test regenerates it\n"
               "// and compares. Each entry: block size, bits, centroids, decision\n"
               "// boundaries (midpoints), mean squared error per coordinate (variance 1).\n");
  for (int block : {64, 128}) {
    const Moments moments(block);
    for (int bits : {2, 3, 4}) {
      const Codebook cb = LloydMax(moments, bits);
      std::fprintf(out, "{%d, %d,\n {", block, bits);
      for (size_t i = 0; i < cb.centroids.size(); ++i) {
        PrintFloat(out, i ? ", " : "", cb.centroids[i]);
      }
      std::fprintf(out, "},\n {");
      for (size_t i = 0; i < cb.boundaries.size(); ++i) {
        PrintFloat(out, i ? ", " : "", cb.boundaries[i]);
      }
      std::fprintf(out, "},\n %.9g},\n", static_cast<double>(cb.mse));
    }
  }
  if (out != stdout && std::fclose(out) != 0) {
    std::perror(argv[1]);
    return 1;
  }
  return 0;
}
