// A small markdown renderer for model answers: headings, lists (nested by indent), bold,
// italic, inline code, fenced code blocks (with a copy button), links, block quotes, rules.
//
// Safety by construction: the whole text is HTML-escaped first, so whatever the model writes
// is shown as text; the renderer only ever adds its own tags, and a link's address is kept only
// for http(s), mailto or a relative path (never javascript: or data:). An unclosed fence (an
// answer still streaming) is a code block up to the end.
"use strict";

const Markdown = (() => {
  function escapeHtml(s) {
    return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  // `url` is already escaped (quotes are entities, so it cannot leave the attribute).
  function safeUrl(url) {
    const raw = url.replace(/&amp;/g, "&").trim();
    if (/^(https?:|mailto:)/i.test(raw)) return url;
    if (/^[a-z][a-z0-9+.-]*:/i.test(raw)) return null; // any other scheme
    return url; // relative
  }

  // Inline markup of one escaped line. Code spans and links are set aside first (as \u0000N\u0000)
  // so that emphasis never rewrites their insides.
  function inline(text) {
    const held = [];
    const hold = (html) => "\u0000" + (held.push(html) - 1) + "\u0000";
    text = text.replace(/`([^`\n]+)`/g, (_, code) => hold("<code>" + code + "</code>"));
    text = text.replace(/\[([^\]\n]+)\]\(([^()\s]+)\)/g, (m, label, url) => {
      const safe = safeUrl(url);
      const inner = emphasis(label);
      return hold(safe === null ? inner
        : '<a href="' + safe + '" target="_blank" rel="noopener noreferrer">' + inner + "</a>");
    });
    text = emphasis(text);
    return text.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
  }

  function emphasis(text) {
    text = text.replace(/\*\*(?=\S)([^*\n]*?\S)\*\*|__(?=\S)([^_\n]*?\S)__/g,
      (_, a, b) => "<strong>" + (a !== undefined ? a : b) + "</strong>");
    text = text.replace(/(^|[^\w*])\*(?=\S)([^*\n]*?\S)\*(?![\w*])/g, "$1<em>$2</em>");
    text = text.replace(/(^|[^\w_])_(?=\S)([^_\n]*?\S)_(?![\w_])/g, "$1<em>$2</em>");
    return text;
  }

  function codeBlock(lang, lines) {
    const label = lang ? '<span class="code-lang">' + lang + "</span>" : "<span></span>";
    return '<div class="code-block"><div class="code-head">' + label +
      '<button type="button" class="copy-code">Copy</button></div><pre><code>' +
      lines.join("\n") + "</code></pre></div>";
  }

  const FENCE = /^\s*(```|~~~)\s*([\w.+#-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s*&gt;\s?(.*)$/;

  function render(source) {
    const lines = escapeHtml(source || "").replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    let lists = []; // open lists, innermost last: {tag, indent}
    let quote = [];

    const flushPara = () => {
      if (para.length) out.push("<p>" + para.map(inline).join("<br>") + "</p>");
      para = [];
    };
    const closeLists = (toIndent) => {
      while (lists.length && lists[lists.length - 1].indent > toIndent) {
        out.push("</li></" + lists.pop().tag + ">");
      }
    };
    const flushQuote = () => {
      if (quote.length) out.push("<blockquote>" + render(quote.join("\n").replace(
        /&amp;|&lt;|&gt;|&quot;|&#39;/g, (e) => ({ "&amp;": "&", "&lt;": "<", "&gt;": ">",
          "&quot;": '"', "&#39;": "'" }[e]))) + "</blockquote>");
      quote = [];
    };
    const flushAll = () => { flushPara(); closeLists(-1); flushQuote(); };

    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(FENCE);
      if (fence) {
        flushAll();
        const body = [];
        let j = i + 1;
        while (j < lines.length && !(lines[j].trim().startsWith(fence[1]) &&
                                     lines[j].trim().replace(/[`~]/g, "") === "")) {
          body.push(lines[j]);
          j++;
        }
        out.push(codeBlock(fence[2], body));
        i = j; // the closing fence (or past the end)
        continue;
      }
      if (!line.trim()) { flushAll(); continue; }
      const q = line.match(QUOTE);
      if (q) { flushPara(); closeLists(-1); quote.push(q[1]); continue; }
      flushQuote();
      const h = line.match(HEADING);
      if (h) {
        flushAll();
        out.push("<h" + h[1].length + ">" + inline(h[2]) + "</h" + h[1].length + ">");
        continue;
      }
      if (RULE.test(line)) { flushAll(); out.push("<hr>"); continue; }
      const item = line.match(ITEM);
      if (item) {
        flushPara();
        const indent = item[1].replace(/\t/g, "    ").length;
        const tag = /\d/.test(item[2]) ? "ol" : "ul";
        closeLists(indent);
        const top = lists[lists.length - 1];
        if (top && top.indent === indent && top.tag !== tag) {
          closeLists(indent - 1);
        }
        const open = lists[lists.length - 1];
        if (open && open.indent === indent) {
          out.push("</li><li>");
        } else {
          const start = tag === "ol" && parseInt(item[2], 10) !== 1
            ? ' start="' + parseInt(item[2], 10) + '"' : "";
          out.push("<" + tag + start + "><li>");
          lists.push({ tag, indent });
        }
        out.push(inline(item[3]));
        continue;
      }
      if (lists.length && /^\s+\S/.test(line)) { // a list item's continuation line
        out.push("<br>" + inline(line.trim()));
        continue;
      }
      closeLists(-1);
      para.push(line);
    }
    flushAll();
    return out.join("");
  }

  return { render, escapeHtml, inline };
})();
