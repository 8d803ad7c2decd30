// What llama.cpp's chat parser makes of gpt-oss replies: for bench/record_llamacpp_harmony.py.
//
//   llamacpp_harmony TEMPLATE_FILE CASES_FILE
//
// TEMPLATE_FILE: a harmony chat template (Jinja). CASES_FILE: one JSON object per line,
// {"reply": TEXT, "tools": BOOL}. For each case the conversation [user "hi"] (with one tool,
// get_weather(city), when "tools") is applied to the template as llama-server applies it
// (reasoning_format auto), and REPLY, the generated text after the generation prompt, is
// parsed with the parser that comes back. One JSON object per line is written to stdout:
// {"prompt", "reasoning_content", "content", "tool_calls": [{"name", "arguments"}]}, or
// {"prompt", "error"} where llama.cpp's parser refuses the reply.
#include "chat.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

using json = nlohmann::ordered_json;

int main(int argc, char ** argv) {
    if (argc != 3) {
        std::cerr << "usage: " << argv[0] << " TEMPLATE_FILE CASES_FILE\n";
        return 2;
    }
    std::ifstream tf(argv[1]);
    std::stringstream src;
    src << tf.rdbuf();
    auto tmpls = common_chat_templates_init(nullptr, src.str());

    std::ifstream cf(argv[2]);
    std::string line;
    while (std::getline(cf, line)) {
        if (line.empty()) {
            continue;
        }
        json c = json::parse(line);
        common_chat_templates_inputs in;
        common_chat_msg user;
        user.role = "user";
        user.content = "hi";
        in.messages = {user};
        in.reasoning_format = COMMON_REASONING_FORMAT_AUTO;
        if (c.value("tools", false)) {
            in.tools = {{"get_weather", "Weather in a city",
                         R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})"}};
        }
        common_chat_params params = common_chat_templates_apply(tmpls.get(), in);
        common_chat_parser_params pp(params);
        pp.reasoning_format = COMMON_REASONING_FORMAT_AUTO;
        pp.parser.load(params.parser);
        json out;
        try {
            common_chat_msg msg = common_chat_parse(c.at("reply").get<std::string>(), false, pp);
            json calls = json::array();
            for (const auto & tc : msg.tool_calls) {
                calls.push_back({{"name", tc.name}, {"arguments", tc.arguments}});
            }
            out = {{"prompt", params.prompt}, {"reasoning_content", msg.reasoning_content},
                   {"content", msg.content}, {"tool_calls", calls}};
        } catch (const std::exception & e) {
            out = {{"prompt", params.prompt}, {"error", e.what()}};
        }
        std::cout << out.dump() << "\n";
    }
    return 0;
}
