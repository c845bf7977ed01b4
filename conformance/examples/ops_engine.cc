// An engine outside Python, checked through the engine protocol (conformance/INTERPRETING.md section 8): the
// primitives and the gated delta rule of reference.py in plain C++17, with no library beyond the standard one.
//
//     c++ -O2 -std=c++17 -o ops_engine conformance/examples/ops_engine.cc
//     python -m conformance run --engine exec:./ops_engine --expectations conformance/examples/ops_engine.json
//
// It reads one JSON request per line on stdin and writes one JSON answer per line on stdout: `hello` (which
// features it has), `run_op` (a primitive or delta-rule case: tensors in, tensors out) and `free` (nothing to free
// here). Tensors travel inline, as base64 of their little-endian values. Everything is computed in double and
// answered as float32. Built with -DDECAY_AFTER_WRITE it has a bug engines have shipped (the state decays after the
// delta-rule write instead of before), which the suite must catch (tests/test_process_engine.py).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// ---------------------------------------------------------------------------------------------------------------
// JSON: just enough of a reader and a writer for the protocol's messages.

struct Json {
    enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
    bool boolean = false;
    double number = 0;
    std::string text;
    std::vector<Json> items;                              // Array
    std::vector<std::pair<std::string, Json>> members;    // Object, in order

    const Json& operator[](const std::string& key) const {
        for (const auto& [name, value] : members)
            if (name == key) return value;
        throw std::runtime_error("missing field '" + key + "'");
    }
    bool has(const std::string& key) const {
        for (const auto& member : members)
            if (member.first == key) return true;
        return false;
    }
};

class Reader {
   public:
    explicit Reader(const std::string& s) : s_(s) {}
    Json document() {
        Json value = parse();
        skip();
        if (i_ != s_.size()) fail("trailing characters");
        return value;
    }

   private:
    const std::string& s_;
    size_t i_ = 0;

    [[noreturn]] void fail(const char* what) {
        throw std::runtime_error(std::string("bad JSON: ") + what + " at byte " + std::to_string(i_));
    }
    void skip() {
        while (i_ < s_.size() && std::strchr(" \t\r\n", s_[i_])) i_++;
    }
    bool literal(const char* word) {
        size_t n = std::strlen(word);
        if (s_.compare(i_, n, word) != 0) return false;
        i_ += n;
        return true;
    }
    Json parse() {
        skip();
        if (i_ >= s_.size()) fail("unexpected end");
        Json v;
        char c = s_[i_];
        if (c == '{') {
            v.kind = Json::Object;
            i_++;
            skip();
            if (s_[i_] == '}') { i_++; return v; }
            for (;;) {
                skip();
                if (s_[i_] != '"') fail("expected a key");
                std::string key = string();
                skip();
                if (s_[i_++] != ':') fail("expected ':'");
                v.members.emplace_back(key, parse());
                skip();
                if (s_[i_] == ',') { i_++; continue; }
                if (s_[i_++] != '}') fail("expected ',' or '}'");
                return v;
            }
        }
        if (c == '[') {
            v.kind = Json::Array;
            i_++;
            skip();
            if (s_[i_] == ']') { i_++; return v; }
            for (;;) {
                v.items.push_back(parse());
                skip();
                if (s_[i_] == ',') { i_++; continue; }
                if (s_[i_++] != ']') fail("expected ',' or ']'");
                return v;
            }
        }
        if (c == '"') { v.kind = Json::String; v.text = string(); return v; }
        if (literal("true")) { v.kind = Json::Bool; v.boolean = true; return v; }
        if (literal("false")) { v.kind = Json::Bool; return v; }
        if (literal("null")) return v;
        char* end = nullptr;
        v.number = std::strtod(s_.c_str() + i_, &end);
        if (end == s_.c_str() + i_) fail("unexpected character");
        v.kind = Json::Number;
        i_ = end - s_.c_str();
        return v;
    }
    std::string string() {   // at the opening quote; \uXXXX outside ASCII is not needed by the protocol's fields
        std::string out;
        for (i_++; i_ < s_.size() && s_[i_] != '"'; i_++) {
            if (s_[i_] != '\\') { out += s_[i_]; continue; }
            char e = s_[++i_];
            const char* from = "\"\\/bfnrt";
            const char* to = "\"\\/\b\f\n\r\t";
            if (const char* p = std::strchr(from, e); p && e) out += to[p - from];
            else if (e == 'u' && i_ + 4 < s_.size()) { out += '?'; i_ += 4; }
            else fail("bad escape");
        }
        if (i_++ >= s_.size()) fail("unterminated string");
        return out;
    }
};

std::string quoted(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') out += '\\', out += c;
        else if (static_cast<unsigned char>(c) < 0x20) out += ' ';
        else out += c;
    }
    return out + "\"";
}

// ---------------------------------------------------------------------------------------------------------------
// Tensors: {"dtype": "F32" | "I64", "shape": [...], "data": base64 of little-endian values} (the runner sends these
// two dtypes; this engine answers F32). Values are held as double.

struct Tensor {
    std::vector<int64_t> shape;
    std::vector<double> values;
    int64_t dim(int axis) const { return shape.at(axis < 0 ? shape.size() + axis : axis); }
};

const char* kBase64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::vector<uint8_t> from_base64(const std::string& text) {
    std::vector<uint8_t> out;
    uint32_t bits = 0;
    int count = 0;
    for (char c : text) {
        if (c == '=') break;
        const char* p = std::strchr(kBase64, c);
        if (!p || !c) throw std::runtime_error("tensor data is not base64");
        bits = (bits << 6) | uint32_t(p - kBase64);
        if ((count += 6) >= 8) out.push_back(uint8_t(bits >> (count -= 8)));
    }
    return out;
}

std::string to_base64(const std::vector<uint8_t>& bytes) {
    std::string out;
    size_t i = 0;
    for (; i + 2 < bytes.size(); i += 3) {
        uint32_t n = bytes[i] << 16 | bytes[i + 1] << 8 | bytes[i + 2];
        for (int s = 18; s >= 0; s -= 6) out += kBase64[(n >> s) & 63];
    }
    if (size_t rest = bytes.size() - i) {
        uint32_t n = bytes[i] << 16 | (rest == 2 ? bytes[i + 1] << 8 : 0);
        out += kBase64[n >> 18 & 63];
        out += kBase64[n >> 12 & 63];
        out += rest == 2 ? kBase64[n >> 6 & 63] : '=';
        out += '=';
    }
    return out;
}

Tensor read_tensor(const Json& spec) {
    Tensor t;
    size_t count = 1;
    for (const Json& n : spec["shape"].items) t.shape.push_back(int64_t(n.number)), count *= size_t(n.number);
    std::vector<uint8_t> raw = from_base64(spec["data"].text);
    const std::string& dtype = spec["dtype"].text;
    size_t width = dtype == "F32" ? 4 : dtype == "I64" ? 8 : 0;
    if (!width) throw std::runtime_error("unexpected tensor dtype " + dtype);
    if (raw.size() != count * width) throw std::runtime_error("tensor data does not match its shape");
    t.values.resize(count);
    for (size_t i = 0; i < count; i++) {   // little-endian hosts: the bytes are the values
        if (width == 4) { float f; std::memcpy(&f, &raw[4 * i], 4); t.values[i] = f; }
        else { int64_t v; std::memcpy(&v, &raw[8 * i], 8); t.values[i] = double(v); }
    }
    return t;
}

std::string write_tensor(const Tensor& t) {
    std::vector<uint8_t> raw(4 * t.values.size());
    for (size_t i = 0; i < t.values.size(); i++) {
        float f = float(t.values[i]);
        std::memcpy(&raw[4 * i], &f, 4);
    }
    std::string shape;
    for (int64_t n : t.shape) shape += (shape.empty() ? "" : ",") + std::to_string(n);
    return "{\"dtype\":\"F32\",\"shape\":[" + shape + "],\"data\":\"" + to_base64(raw) + "\"}";
}

// ---------------------------------------------------------------------------------------------------------------
// The operations, as reference.py defines them (INTERPRETING.md section 3, "Kinds"). Arrays are row-major.

using Inputs = std::map<std::string, Tensor>;
using Outputs = std::vector<std::pair<std::string, Tensor>>;

double silu(double x) { return x / (1 + std::exp(-x)); }

// x / sqrt(mean(x^2) + eps) over the last axis, times scale(j, row) (rms_norm: 1 + w[j]; gated: w[j] * silu(z))
template <class Scale>
Tensor normalised_rows(const Tensor& x, double eps, bool mean, Scale scale) {
    Tensor y = x;
    size_t n = size_t(x.dim(-1));
    for (size_t row = 0; n && row * n < x.values.size(); row++) {
        const double* v = &x.values[row * n];
        double sum = 0;
        for (size_t j = 0; j < n; j++) sum += v[j] * v[j];
        double inv = 1 / std::sqrt((mean ? sum / n : sum) + eps);
        for (size_t j = 0; j < n; j++) y.values[row * n + j] = v[j] * inv * scale(j, row);
    }
    return y;
}

Outputs rms_norm(const Inputs& in, const Json& attrs) {
    const Tensor& w = in.at("weight");
    return {{"y", normalised_rows(in.at("x"), attrs["eps"].number, true,
                                  [&](size_t j, size_t) { return 1 + w.values[j]; })}};
}

Outputs rms_norm_gated(const Inputs& in, const Json& attrs) {
    const Tensor &w = in.at("weight"), &z = in.at("z");
    size_t n = size_t(w.dim(0));
    return {{"y", normalised_rows(in.at("x"), attrs["eps"].number, true, [&](size_t j, size_t row) {
                 return w.values[j] * silu(z.values[row * n + j]);
             })}};
}

Outputs l2norm(const Inputs& in, const Json& attrs) {
    return {{"y", normalised_rows(in.at("x"), attrs["eps"].number, false, [](size_t, size_t) { return 1.0; })}};
}

// NeoX partial rotary embedding: dims [0, R) rotate in pairs (i, i + R/2). The angles are float32, as in
// reference.rope (and transformers); their cos and sin are taken in double.
Outputs rope(const Inputs& in, const Json& attrs) {
    const Tensor &x = in.at("x"), &positions = in.at("positions");
    int64_t T = x.dim(0), H = x.dim(1), Dh = x.dim(2);
    int64_t R = int64_t(Dh * attrs["partial_rotary_factor"].number), half = R / 2;
    float theta = float(attrs["rope_theta"].number);
    Tensor y = x;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            float inv_freq = std::pow(theta, -(float(2 * i) / float(R)));
            double angle = float(positions.values[t]) * inv_freq;
            double c = std::cos(angle), s = std::sin(angle);
            for (int64_t h = 0; h < H; h++) {
                const double* v = &x.values[(t * H + h) * Dh];
                double* out = &y.values[(t * H + h) * Dh];
                out[i] = v[i] * c - v[i + half] * s;
                out[i + half] = v[i + half] * c + v[i] * s;
            }
        }
    return {{"y", y}};
}

// Depthwise causal conv over [window; x]: y[t, c] = sum_i weight[c, i] * padded[t + i, c]; the new window is the
// last W-1 rows of [window; x].
Outputs causal_conv1d(const Inputs& in, const Json&) {
    const Tensor &x = in.at("x"), &window = in.at("window"), &weight = in.at("weight");
    int64_t T = x.dim(0), C = x.dim(1), W = weight.dim(1);
    std::vector<double> padded(window.values);
    padded.insert(padded.end(), x.values.begin(), x.values.end());
    Tensor y{{T, C}, std::vector<double>(T * C)};
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < C; c++) {
            double sum = 0;
            for (int64_t i = 0; i < W; i++) sum += weight.values[c * W + i] * padded[(t + i) * C + c];
            y.values[t * C + c] = sum;
        }
    Tensor last{{W - 1, C}, std::vector<double>(padded.end() - (W - 1) * C, padded.end())};
    return {{"y", y}, {"window", last}};
}

// The gated delta rule, token by token, per value head h (reading key head h / (Hv / Hk)), with q scaled by
// Dk^-1/2:  S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q.
Outputs gated_delta_rule(const Inputs& in, const Json&) {
    const Tensor &q = in.at("q"), &k = in.at("k"), &v = in.at("v"), &g = in.at("g"), &beta = in.at("beta");
    Tensor S = in.at("initial_state");
    int64_t T = q.dim(0), Hk = q.dim(1), Dk = q.dim(2), Hv = v.dim(1), Dv = v.dim(2);
    double scale = 1 / std::sqrt(double(Dk));
    Tensor o{{T, Hv, Dv}, std::vector<double>(T * Hv * Dv)};
    std::vector<double> delta(Dv);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hv; h++) {
            const double* kt = &k.values[(t * Hk + h / (Hv / Hk)) * Dk];
            const double* qt = &q.values[(t * Hk + h / (Hv / Hk)) * Dk];
            double* Sh = &S.values[h * Dk * Dv];
            double decay = std::exp(g.values[t * Hv + h]), b = beta.values[t * Hv + h];
#ifndef DECAY_AFTER_WRITE
            for (int64_t i = 0; i < Dk * Dv; i++) Sh[i] *= decay;
#endif
            for (int64_t j = 0; j < Dv; j++) {
                double predicted = 0;
                for (int64_t i = 0; i < Dk; i++) predicted += Sh[i * Dv + j] * kt[i];
                delta[j] = b * (v.values[(t * Hv + h) * Dv + j] - predicted);
            }
            for (int64_t i = 0; i < Dk; i++)
                for (int64_t j = 0; j < Dv; j++) Sh[i * Dv + j] += kt[i] * delta[j];
#ifdef DECAY_AFTER_WRITE
            for (int64_t i = 0; i < Dk * Dv; i++) Sh[i] *= decay;
#endif
            for (int64_t j = 0; j < Dv; j++) {
                double sum = 0;
                for (int64_t i = 0; i < Dk; i++) sum += Sh[i * Dv + j] * qt[i] * scale;
                o.values[(t * Hv + h) * Dv + j] = sum;
            }
        }
    return {{"o", o}, {"final_state", S}};
}

// ---------------------------------------------------------------------------------------------------------------
// The protocol: hello, run_op, free; every other op is answered as a failure.

using Op = Outputs (*)(const Inputs&, const Json&);
const std::map<std::string, Op> kOps = {
    {"rms_norm", rms_norm}, {"rms_norm_gated", rms_norm_gated}, {"l2norm", l2norm}, {"rope", rope},
    {"causal_conv1d", causal_conv1d}, {"gated_delta_rule", gated_delta_rule}};

std::string answer(const Json& request) {
    const std::string& op = request["op"].text;
    if (op == "hello")
        return "\"protocol\":1,\"precision\":\"fp32\",\"features\":"
               "[\"ops\",\"gated_delta_rule\"]";   // "ops": the group of the five primitives
    if (op == "free") return "";
    if (op != "run_op") throw std::runtime_error("unsupported op " + op);
    const std::string& kind = request["kind"].text;
    auto found = kOps.find(kind);
    if (found == kOps.end()) throw std::runtime_error("unsupported kind " + kind);
    Inputs inputs;
    for (const auto& [name, spec] : request["inputs"].members) inputs[name] = read_tensor(spec);
    std::string outputs;
    for (const auto& [name, tensor] : found->second(inputs, request["attrs"]))
        outputs += (outputs.empty() ? "" : ",") + quoted(name) + ":" + write_tensor(tensor);
    return "\"outputs\":{" + outputs + "}";
}

int main() {
    std::ios::sync_with_stdio(false);
    std::string line;
    while (std::getline(std::cin, line)) {
        std::string id = "null", reply;
        try {
            Json request = Reader(line).document();
            id = std::to_string(int64_t(request["id"].number));
            std::string fields = answer(request);
            reply = "{\"id\":" + id + ",\"ok\":true" + (fields.empty() ? "" : "," + fields) + "}";
        } catch (const std::exception& e) {
            reply = "{\"id\":" + id + ",\"ok\":false,\"error\":" + quoted(e.what()) + "}";
        }
        std::cout << reply << '\n' << std::flush;
    }
}
