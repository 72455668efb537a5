// Command surface counts the exported API of the module: per package and in all, the
// exported top-level names (functions, types, variables, constants), the exported methods
// of exported types, and the exported fields and interface methods of exported types. Test
// files, internal/ packages, main packages, testutil and examples are left out: what a user
// of the library can name.
//
//	go run ./internal/surface          # a line per package, then the total
//	go run ./internal/surface -total   # the total alone
//
// docs/PACKAGES.md ("API surface") records the figure; a change that adds to it says why.
package main

import (
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

func main() {
	total := flag.Bool("total", false, "print the total only")
	root := flag.String("root", ".", "module root")
	flag.Parse()
	counts, err := count(*root)
	if err != nil {
		fmt.Fprintln(os.Stderr, "surface:", err)
		os.Exit(1)
	}
	var dirs []string
	sum := 0
	for d, n := range counts {
		dirs = append(dirs, d)
		sum += n
	}
	if *total {
		fmt.Println(sum)
		return
	}
	sort.Slice(dirs, func(i, j int) bool {
		if counts[dirs[i]] != counts[dirs[j]] {
			return counts[dirs[i]] > counts[dirs[j]]
		}
		return dirs[i] < dirs[j]
	})
	for _, d := range dirs {
		fmt.Printf("%6d  %s\n", counts[d], d)
	}
	fmt.Printf("%6d  total (%d packages)\n", sum, len(dirs))
}

// skipped reports whether the package in dir (relative to the module root) is not part of
// the library's API.
func skipped(dir string) bool {
	for _, part := range strings.Split(filepath.ToSlash(dir), "/") {
		switch part {
		case "internal", "testutil", "examples", "cmd", "testdata", "vendor":
			return true
		}
		if strings.HasPrefix(part, ".") && part != "." {
			return true
		}
	}
	return false
}

// count returns the exported identifiers of each library package under root.
func count(root string) (map[string]int, error) {
	out := map[string]int{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if skipped(rel) {
			return filepath.SkipDir
		}
		n, isLib, err := countDir(path)
		if err != nil {
			return err
		}
		if isLib && n > 0 {
			out[filepath.ToSlash(rel)] = n
		}
		return nil
	})
	return out, err
}

func countDir(dir string) (n int, isLib bool, err error) {
	fset := token.NewFileSet()
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, false, err
	}
	types := map[string]bool{} // exported type names of the package
	var files []*ast.File
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.SkipObjectResolution)
		if err != nil {
			return 0, false, err
		}
		if f.Name.Name == "main" {
			return 0, false, nil
		}
		files = append(files, f)
		for _, decl := range f.Decls {
			if gd, ok := decl.(*ast.GenDecl); ok && gd.Tok == token.TYPE {
				for _, s := range gd.Specs {
					if ts := s.(*ast.TypeSpec); ts.Name.IsExported() {
						types[ts.Name.Name] = true
					}
				}
			}
		}
	}
	if len(files) == 0 {
		return 0, false, nil
	}
	for _, f := range files {
		for _, decl := range f.Decls {
			switch d := decl.(type) {
			case *ast.FuncDecl:
				if !d.Name.IsExported() {
					continue
				}
				if d.Recv == nil || types[recvName(d.Recv.List[0].Type)] {
					n++
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.ValueSpec:
						for _, id := range s.Names {
							if id.IsExported() {
								n++
							}
						}
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							n += 1 + members(s.Type)
						}
					}
				}
			}
		}
	}
	return n, true, nil
}

// members counts the exported fields of a struct type and the methods of an interface.
func members(t ast.Expr) int {
	n := 0
	switch t := t.(type) {
	case *ast.StructType:
		for _, f := range t.Fields.List {
			for _, id := range f.Names {
				if id.IsExported() {
					n++
				}
			}
		}
	case *ast.InterfaceType:
		for _, m := range t.Methods.List {
			for _, id := range m.Names {
				if id.IsExported() {
					n++
				}
			}
		}
	}
	return n
}

func recvName(e ast.Expr) string {
	switch t := e.(type) {
	case *ast.StarExpr:
		return recvName(t.X)
	case *ast.IndexExpr:
		return recvName(t.X)
	case *ast.IndexListExpr:
		return recvName(t.X)
	case *ast.Ident:
		return t.Name
	}
	return ""
}
