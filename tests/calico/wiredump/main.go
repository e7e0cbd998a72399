// Prints the Felix wire field table of the Calico module this module requires, as
// JSON: every message reachable from ToDataplane and FromDataplane, with each field's
// name, number, type, label and oneof, and the enums' values. The same shape as
// proto/tests/fixtures/felix-wire.json, which proto/tests/wire_compat.rs checks our
// descriptors against; scripts/calico.sh builds it beside Felix.
package main

import (
	"encoding/json"
	"os"
	"strings"

	fp "github.com/projectcalico/calico/felix/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

type field struct {
	Name   string `json:"name"`
	Number int32  `json:"number"`
	Type   string `json:"type"`
	Label  string `json:"label,omitempty"`
	Oneof  string `json:"oneof,omitempty"`
}

func typeName(f protoreflect.FieldDescriptor) string {
	if f.IsMap() {
		return "map<" + typeName(f.MapKey()) + "," + typeName(f.MapValue()) + ">"
	}
	switch f.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return string(f.Message().Name())
	case protoreflect.EnumKind:
		return string(f.Enum().Name())
	}
	return f.Kind().String()
}

func main() {
	msgs := map[string][]field{}
	enums := map[string]map[string]int32{}
	var walk func(m protoreflect.MessageDescriptor)
	walk = func(m protoreflect.MessageDescriptor) {
		name := strings.TrimPrefix(string(m.FullName()), "felix.")
		if _, ok := msgs[name]; ok {
			return
		}
		msgs[name] = nil
		fs := []field{}
		for i := 0; i < m.Fields().Len(); i++ {
			f := m.Fields().Get(i)
			out := field{Name: string(f.Name()), Number: int32(f.Number()), Type: typeName(f)}
			if f.IsList() {
				out.Label = "repeated"
			} else if f.HasOptionalKeyword() {
				out.Label = "optional"
			}
			if o := f.ContainingOneof(); o != nil && !o.IsSynthetic() {
				out.Oneof = string(o.Name())
			}
			fs = append(fs, out)
			if f.IsMap() {
				f = f.MapValue()
			}
			if f.Kind() == protoreflect.MessageKind {
				walk(f.Message())
			}
			if f.Kind() == protoreflect.EnumKind {
				e := f.Enum()
				vals := map[string]int32{}
				for j := 0; j < e.Values().Len(); j++ {
					vals[string(e.Values().Get(j).Name())] = int32(e.Values().Get(j).Number())
				}
				enums[strings.TrimPrefix(string(e.FullName()), "felix.")] = vals
			}
		}
		msgs[name] = fs
	}
	walk((&fp.ToDataplane{}).ProtoReflect().Descriptor())
	walk((&fp.FromDataplane{}).ProtoReflect().Descriptor())
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(map[string]any{"messages": msgs, "enums": enums}); err != nil {
		panic(err)
	}
}
