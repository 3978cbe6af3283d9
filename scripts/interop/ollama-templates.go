// Renders rtune's Ollama templates with Go's own text/template, as Ollama renders a Modelfile's
// TEMPLATE (missingkey=zero; .Messages a list of messages with Role and Content, .System, and an
// empty .Response). Reads the cases rtune writes (a JSON list of {family, template, messages,
// system}) on stdin and prints [{family, text}] as JSON: the fixture
// tests/fixtures/templates/ollama-go.json that rtune's own renderer is checked against.
// Run through scripts/interop/ollama-templates.sh.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type Case struct {
	Family   string    `json:"family"`
	Template string    `json:"template"`
	Messages []Message `json:"messages"`
	System   string    `json:"system"`
}

type Rendered struct {
	Family string `json:"family"`
	Text   string `json:"text"`
}

func main() {
	var cases []Case
	if err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
		fmt.Fprintln(os.Stderr, "reading the cases:", err)
		os.Exit(1)
	}
	out := []Rendered{}
	for _, c := range cases {
		t, err := template.New("").Option("missingkey=zero").Parse(c.Template)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", c.Family, err)
			os.Exit(1)
		}
		msgs := make([]*Message, len(c.Messages))
		for i := range c.Messages {
			msgs[i] = &c.Messages[i]
		}
		var b strings.Builder
		if err := t.Execute(&b, map[string]any{"System": c.System, "Messages": msgs, "Response": ""}); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", c.Family, err)
			os.Exit(1)
		}
		out = append(out, Rendered{Family: c.Family, Text: b.String()})
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
