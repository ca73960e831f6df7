// JSON read strictly (a checkpoint's manifest, the C API's options): bounded
// nesting, and no object that gives a key twice. RFC 8259 leaves such a
// key's value to the reader (the last wins in nlohmann's parser and in
// Python's json, the first in others): refused, never guessed.
#pragma once

#include <cstddef>
#include <set>
#include <string>
#include <vector>

namespace embedcore::checkpoint::strict_json {

// At most this many bytes of a repeated key go into a message (then "...").
constexpr size_t kMaxKeyQuoted = 200;

// Parses [begin, end) into `out` (nlohmann's exceptions for text that is not
// JSON), calling `too_deep()`, which throws, past `max_depth` levels. Returns
// the first key that an object gives twice, as JSON text ("\"verify\"") cut
// to kMaxKeyQuoted bytes at a UTF-8 character boundary, or "" when there is
// none. The keys are counted as they come and compared with
// the object's size when it ends (a repeated key overwrites: fewer entries
// than keys); only then is the text read again, each object's keys kept, to
// name the key.
template <typename Json, typename TooDeep>
std::string Parse(const char* begin, const char* end, int max_depth, TooDeep too_deep, Json* out) {
  using Event = typename Json::parse_event_t;
  std::vector<size_t> counts;
  bool repeated = false;
  *out = Json::parse(begin, end, [&](int depth, Event event, Json& parsed) {
    if (depth > max_depth) too_deep();
    if (event == Event::object_start) {
      counts.push_back(0);
    } else if (event == Event::key) {
      ++counts.back();
    } else if (event == Event::object_end) {
      repeated = repeated || parsed.size() != counts.back();
      counts.pop_back();
    }
    return true;
  });
  if (!repeated) return "";
  std::vector<std::set<std::string>> keys;
  std::string first;
  const Json again = Json::parse(begin, end, [&](int, Event event, Json& parsed) {
    if (event == Event::object_start) {
      keys.emplace_back();
    } else if (event == Event::object_end) {
      keys.pop_back();
    } else if (event == Event::key && !keys.back().insert(parsed.template get<std::string>()).second &&
               first.empty()) {
      first = parsed.dump();
    }
    return true;
  });
  (void)again;  // (read for its keys alone)
  if (first.size() > kMaxKeyQuoted) {
    size_t cut = kMaxKeyQuoted;
    while (cut > 0 && (static_cast<unsigned char>(first[cut]) & 0xC0) == 0x80) --cut;
    first.resize(cut);
    first += "...";
  }
  return first;
}

}  // namespace embedcore::checkpoint::strict_json
