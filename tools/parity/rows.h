// What the parity harnesses share: one row of logits printed as its TOP best
// [id, log-probability] pairs (a JSON array), the log-softmax taken in double precision.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

// Returns the best id.
static int print_row(const float * logits, int n_vocab, int top) {
    double mx = -INFINITY;
    for (int i = 0; i < n_vocab; i++) mx = std::max(mx, (double) logits[i]);
    double sum = 0.0;
    for (int i = 0; i < n_vocab; i++) sum += std::exp((double) logits[i] - mx);
    double lse = mx + std::log(sum);
    std::vector<int> idx(n_vocab);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + top, idx.end(), [&](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    printf("[");
    for (int k = 0; k < top; k++) {
        printf("%s[%d,%.6f]", k ? "," : "", idx[k], (double) logits[idx[k]] - lse);
    }
    printf("]\n");
    return idx[0];
}
