#!/usr/bin/env bash
# Re-create book/_static/mathjax/: the MathJax 3 the book's pages load instead of a CDN copy,
# so that math renders offline and the build needs no network.
#
#     bash scripts/fetch_mathjax.sh
#
# It takes the pinned release from the npm registry (`npm pack`, checked against the
# registry's integrity hash) and keeps only what the pages load: the combined TeX-input /
# CommonHTML-output component with every TeX extension built in (nothing is loaded on
# demand), the web fonts it uses, and the licence (Apache-2.0). `_config.yml` points
# Sphinx's `mathjax_path` at it.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=3.2.2
TARBALL_SHA256=1b9c0a1c44df864e915690558e72adb9cc5203360daefd385084ced3b6c64c09
DEST=book/_static/mathjax

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "mathjax@$VERSION" >/dev/null)
echo "$TARBALL_SHA256  $tmp/mathjax-$VERSION.tgz" | sha256sum --check --quiet
tar -xzf "$tmp/mathjax-$VERSION.tgz" -C "$tmp"

rm -rf "$DEST"
mkdir -p "$DEST/es5/output/chtml/fonts"
cp "$tmp/package/LICENSE" "$DEST/LICENSE"
cp "$tmp/package/es5/tex-chtml-full.js" "$DEST/es5/"
cp -r "$tmp/package/es5/output/chtml/fonts/woff-v2" "$DEST/es5/output/chtml/fonts/"
cat > "$DEST/VERSION" <<END
MathJax $VERSION from the npm registry (package "mathjax"), licensed under Apache-2.0 (LICENSE).
Only es5/tex-chtml-full.js and its fonts are kept. Re-create with: bash scripts/fetch_mathjax.sh
END
du -sh "$DEST"
