// A small Markdown renderer for the chat page. It builds DOM nodes with createElement and
// text nodes only: model text is never parsed as HTML, so any HTML in it shows as text.
// Blocks: fenced code (``` or ~~~, with a copy button), ATX headings, bullet and numbered lists
// (nested by indentation), block quotes, rules, paragraphs. Inline: code spans, **strong**,
// *emphasis* / _emphasis_, ~~strike~~, [links](http…) and autolinked URLs. Images become links
// (the page loads nothing from elsewhere).

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}> ?(.*)$/;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// Only these schemes become links: a javascript: or data: URL stays text.
function safeHref(url) {
  const u = url.trim();
  return /^(https?:\/\/|mailto:)/i.test(u) ? u : null;
}

function link(text, href, parent) {
  const a = el('a');
  a.href = href;
  a.rel = 'noopener noreferrer nofollow';
  a.target = '_blank';
  inline(text, a);
  parent.appendChild(a);
}

// Inline spans of `s` appended to `parent`. Code spans first (their content is literal), then
// links, then emphasis, each found left to right.
const INLINE = [
  ['code', /(`+)([^]*?[^`])\1(?!`)/],
  ['img', /!\[([^\]]*)\]\(\s*([^()\s]+)(?:\s+"[^"]*")?\s*\)/],
  ['link', /\[([^\]]+)\]\(\s*([^()\s]+)(?:\s+"[^"]*")?\s*\)/],
  ['url', /\bhttps?:\/\/[^\s<>()]*[^\s<>().,;:!?'"]/],
  ['strong', /(\*\*|__)(?=\S)([^]*?\S)\1/],
  ['strike', /~~(?=\S)([^]*?\S)~~/],
  ['em', /(\*|_)(?=\S)([^]*?\S)\1(?![*_])/],
];

export function inline(s, parent) {
  while (s.length > 0) {
    let best = null;
    for (const [kind, re] of INLINE) {
      const m = re.exec(s);
      if (m && (best === null || m.index < best.m.index)) best = { kind, m };
    }
    if (best === null) {
      parent.appendChild(document.createTextNode(s));
      return;
    }
    const { kind, m } = best;
    // `_` and `__` inside a word (snake_case, a__b__c) are not emphasis.
    const end = m.index + m[0].length;
    if ((kind === 'em' || kind === 'strong') && m[1][0] === '_' &&
        ((m.index > 0 && /\w/.test(s[m.index - 1])) || (end < s.length && /\w/.test(s[end])))) {
      parent.appendChild(document.createTextNode(s.slice(0, m.index + 1)));
      s = s.slice(m.index + 1);
      continue;
    }
    if (m.index > 0) parent.appendChild(document.createTextNode(s.slice(0, m.index)));
    if (kind === 'code') {
      parent.appendChild(el('code', null, m[2].replace(/^ (.*) $/, '$1')));
    } else if (kind === 'link' || kind === 'img') {
      const href = safeHref(m[2]);
      if (href) link(m[1] || href, href, parent);
      else parent.appendChild(document.createTextNode(m[0]));
    } else if (kind === 'url') {
      link(m[0], m[0], parent);
    } else {
      const tag = { strong: 'strong', strike: 'del', em: 'em' }[kind];
      const e = el(tag);
      inline(kind === 'strike' ? m[1] : m[2], e);
      parent.appendChild(e);
    }
    s = s.slice(m.index + m[0].length);
  }
}

function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  // Plain http beyond localhost has no clipboard API: a hidden textarea and execCommand.
  const t = el('textarea', 'offscreen');
  t.value = text;
  document.body.appendChild(t);
  t.select();
  try {
    document.execCommand('copy');
  } finally {
    t.remove();
  }
  return Promise.resolve();
}

function codeBlock(lang, text, parent) {
  const wrap = el('div', 'code');
  const bar = el('div', 'code-bar');
  bar.appendChild(el('span', 'code-lang', lang || 'text'));
  const btn = el('button', 'copy', 'Copy');
  btn.type = 'button';
  btn.addEventListener('click', () => {
    copyText(text).then(
      () => { btn.textContent = 'Copied'; setTimeout(() => { btn.textContent = 'Copy'; }, 1200); },
      () => { btn.textContent = 'Copy failed'; },
    );
  });
  bar.appendChild(btn);
  const pre = el('pre');
  const code = el('code', lang ? 'language-' + lang.replace(/[^\w+#.-]/g, '') : null, text);
  pre.appendChild(code);
  wrap.appendChild(bar);
  wrap.appendChild(pre);
  parent.appendChild(wrap);
}

// A list from lines[i] on; returns the index after it. Items are nested by indentation.
function list(lines, i, parent) {
  const first = ITEM.exec(lines[i]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const l = el(ordered ? 'ol' : 'ul');
  if (ordered && parseInt(first[2], 10) !== 1) l.start = parseInt(first[2], 10);
  let li = null;
  let text = [];
  const flush = () => {
    if (li && text.length) inline(text.join('\n'), li);
    text = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    const m = ITEM.exec(line);
    if (m && m[1].length > indent) {
      flush();
      i = list(lines, i, li || l);
      continue;
    }
    if (m && m[1].length <= indent) {
      if (m[1].length < indent || /\d/.test(m[2]) !== ordered) break;
      flush();
      li = el('li');
      l.appendChild(li);
      text.push(m[3]);
    } else if (line.trim() === '' || !li || FENCE.test(line) || HEADING.test(line)) {
      break;
    } else {
      text.push(line.trim());
    }
    i++;
  }
  flush();
  parent.appendChild(l);
  return i;
}

// Renders `src` into `parent` (emptied first).
export function render(src, parent) {
  parent.replaceChildren();
  blocks(src.replace(/\r\n?/g, '\n').split('\n'), parent);
}

function blocks(lines, parent) {
  let i = 0;
  let para = [];
  const flush = () => {
    if (para.length) {
      const p = el('p');
      inline(para.join('\n'), p);
      parent.appendChild(p);
    }
    para = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      flush();
      const close = new RegExp('^ {0,3}' + m[1][0] + '{' + m[1].length + ',}\\s*$');
      const body = [];
      i++;
      while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
      i++; // the closing fence (or the end: an unclosed block while it streams)
      codeBlock(m[2], body.join('\n'), parent);
    } else if ((m = HEADING.exec(line))) {
      flush();
      const h = el('h' + m[1].length);
      inline(m[2] || '', h);
      parent.appendChild(h);
      i++;
    } else if (RULE.test(line)) {
      flush();
      parent.appendChild(el('hr'));
      i++;
    } else if (QUOTE.test(line)) {
      flush();
      const body = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        body.push(m[1]);
        i++;
      }
      const q = el('blockquote');
      blocks(body, q);
      parent.appendChild(q);
    } else if (ITEM.test(line) && (para.length === 0 || /^\s*([-*+]|1[.)])\s/.test(line))) {
      flush();
      i = list(lines, i, parent);
    } else if (line.trim() === '') {
      flush();
      i++;
    } else {
      para.push(line);
      i++;
    }
  }
  flush();
}
