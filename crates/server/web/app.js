// The chat page: a conversation streamed from /v1/chat/completions (server-sent events), with
// a stop button (aborting the fetch closes the connection, and the server stops generating),
// a system prompt, sampling settings and an API key kept in localStorage.

import { render } from './markdown.js';

const $ = (id) => document.getElementById(id);
const SAMPLING = ['temperature', 'top_p', 'top_k', 'min_p', 'max_tokens', 'seed'];
const INTEGER = new Set(['top_k', 'max_tokens', 'seed']);
const STORE = 'quiver.chat.';

const state = {
  messages: [], // {role, content} of the conversation, system prompt excluded
  model: null,
  busy: null, // the AbortController of the answer being streamed
};

function load(name, fallback) {
  try {
    return localStorage.getItem(STORE + name) ?? fallback;
  } catch {
    return fallback;
  }
}

function save(name, value) {
  try {
    if (value === '' || value === null) localStorage.removeItem(STORE + name);
    else localStorage.setItem(STORE + name, value);
  } catch {
    // Storage off (a private window's policy): settings last as long as the page.
  }
}

function headers() {
  const h = { 'Content-Type': 'application/json' };
  const key = $('api-key').value.trim();
  if (key) h.Authorization = 'Bearer ' + key;
  return h;
}

function notice(text) {
  const n = $('notice');
  n.textContent = text || '';
  n.hidden = !text;
}

function showSettings(open) {
  $('settings').hidden = !open;
  $('toggle-settings').setAttribute('aria-expanded', String(open));
}

function needKey(message) {
  showSettings(true);
  $('key-box').classList.add('wanted');
  notice(message || 'This server needs an API key: enter it under Settings.');
  $('api-key').focus();
}

// The request's sampling fields: only those set (the rest take the server's defaults).
function sampling() {
  const out = {};
  for (const name of SAMPLING) {
    const raw = $(name).value.trim();
    if (raw === '') continue;
    const v = INTEGER.has(name) ? parseInt(raw, 10) : parseFloat(raw);
    if (Number.isFinite(v)) out[name] = v;
  }
  return out;
}

async function errorText(res) {
  const body = await res.text();
  try {
    const e = JSON.parse(body).error;
    if (e && e.message) return e.message;
  } catch {
    // not JSON: the body as it is
  }
  return body || res.status + ' ' + res.statusText;
}

async function fetchModel() {
  try {
    const res = await fetch('/v1/models', { headers: headers() });
    if (res.status === 401) {
      needKey();
      return;
    }
    if (!res.ok) return;
    const data = await res.json();
    state.model = data.data && data.data[0] ? data.data[0].id : null;
    $('model').textContent = state.model || '';
    $('key-box').classList.remove('wanted');
    notice('');
  } catch (e) {
    notice('Cannot reach the server: ' + e.message);
  }
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function scrollDown(force) {
  const m = $('messages');
  if (force || m.scrollHeight - m.scrollTop - m.clientHeight < 80) m.scrollTop = m.scrollHeight;
}

function addMessage(role, content) {
  $('empty').hidden = true;
  const box = el('div', 'msg ' + role);
  box.appendChild(el('div', 'role', role === 'user' ? 'You' : 'Assistant'));
  const body = el('div', 'body');
  box.appendChild(body);
  if (role === 'user') body.textContent = content;
  else render(content, body);
  $('messages').appendChild(box);
  scrollDown(true);
  return box;
}

// The assistant's answer as it streams: the reasoning (collapsible) and the text, re-rendered
// at most once a frame.
class Answer {
  constructor() {
    this.box = addMessage('assistant', '');
    this.body = this.box.querySelector('.body');
    this.content = '';
    this.reasoning = '';
    this.details = null;
    this.pending = false;
    this.box.classList.add('streaming');
  }

  add(delta) {
    if (delta.reasoning_content) this.reasoning += delta.reasoning_content;
    if (delta.content) this.content += delta.content;
    if (!this.pending) {
      this.pending = true;
      requestAnimationFrame(() => this.draw());
    }
  }

  draw() {
    this.pending = false;
    if (this.reasoning && !this.details) {
      this.details = el('details', 'reasoning');
      this.details.appendChild(el('summary', null, 'Reasoning'));
      this.details.appendChild(el('div', 'reasoning-body'));
      this.box.insertBefore(this.details, this.body);
    }
    if (this.details) render(this.reasoning, this.details.querySelector('.reasoning-body'));
    render(this.content, this.body);
    this.box.dataset.raw = this.content;
    scrollDown(false);
  }

  end(note, cls) {
    this.draw();
    this.box.classList.remove('streaming');
    if (note) this.box.appendChild(el('div', 'note ' + (cls || ''), note));
  }
}

// Reads server-sent events from a fetch response, calling onData with each event's data.
async function readEvents(res, onData) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let at;
    while ((at = buf.search(/\r?\n\r?\n/)) >= 0) {
      const event = buf.slice(0, at);
      buf = buf.slice(at).replace(/^\r?\n\r?\n/, '');
      const data = event
        .split(/\r?\n/)
        .filter((l) => l.startsWith('data:'))
        .map((l) => l.slice(5).replace(/^ /, ''))
        .join('\n');
      if (data && onData(data) === false) return;
    }
  }
}

function stats(s) {
  const parts = [];
  // Without the usage chunk (a stopped answer), the count is of chunks: about one a token.
  if (s.tokens) parts.push((s.counted ? '' : '~') + s.tokens + ' tokens');
  if (s.tps) parts.push(s.tps.toFixed(1) + ' tokens/s');
  if (s.ttft !== null) parts.push('first token ' + (s.ttft / 1000).toFixed(2) + ' s');
  if (s.finish) parts.push('finish: ' + s.finish);
  $('stats').textContent = parts.join(' · ');
}

async function send(text) {
  const conversation = state.messages.concat([{ role: 'user', content: text }]);
  const system = $('system').value.trim();
  const body = {
    messages: (system ? [{ role: 'system', content: system }] : []).concat(conversation),
    stream: true,
    stream_options: { include_usage: true },
    ...sampling(),
  };
  if (state.model) body.model = state.model;
  state.messages = conversation;
  addMessage('user', text);
  const answer = new Answer();
  const ctl = new AbortController();
  setBusy(ctl);
  const t0 = performance.now();
  const s = { tokens: 0, counted: false, tps: 0, ttft: null, finish: null };
  let first = null;
  let last = null;
  const speed = () => {
    if (first !== null && last > first && s.tokens > 1) s.tps = ((s.tokens - 1) * 1000) / (last - first);
  };
  try {
    const res = await fetch('/v1/chat/completions', {
      method: 'POST',
      headers: headers(),
      body: JSON.stringify(body),
      signal: ctl.signal,
    });
    if (!res.ok) {
      const msg = await errorText(res);
      if (res.status === 401) needKey(msg);
      answer.end('Error: ' + msg, 'error');
      conversation.pop();
      return;
    }
    await readEvents(res, (data) => {
      if (data === '[DONE]') return false;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || 'server error');
      for (const c of chunk.choices || []) {
        const d = c.delta || {};
        if (d.content || d.reasoning_content) {
          const now = performance.now();
          if (first === null) {
            first = now;
            s.ttft = now - t0;
          }
          last = now;
          if (!s.counted) s.tokens += 1;
          answer.add(d);
        }
        if (c.finish_reason) s.finish = c.finish_reason;
      }
      if (chunk.usage) {
        s.tokens = chunk.usage.completion_tokens;
        s.counted = true;
      }
      speed();
      stats(s);
      return true;
    });
    answer.end(s.finish === 'length' ? 'Stopped at max_tokens.' : '');
  } catch (e) {
    if (e.name === 'AbortError') {
      answer.end('Stopped.', 'stopped');
      s.finish = 'stopped';
    } else {
      ctl.abort(); // closes the connection: the server stops generating
      answer.end('Error: ' + e.message, 'error');
    }
  } finally {
    speed();
    stats(s);
    setBusy(null);
  }
  // What was answered, even if stopped, is the conversation's next turn (unless New chat
  // started another conversation meanwhile).
  if (state.messages !== conversation) return;
  if (answer.content) conversation.push({ role: 'assistant', content: answer.content });
  else conversation.pop();
}

function setBusy(ctl) {
  state.busy = ctl;
  $('send').hidden = !!ctl;
  $('stop').hidden = !ctl;
  $('composer').classList.toggle('busy', !!ctl);
}

function newChat() {
  if (state.busy) state.busy.abort();
  state.messages = [];
  for (const m of document.querySelectorAll('#messages .msg')) m.remove();
  $('empty').hidden = false;
  $('stats').textContent = '';
  $('prompt').focus();
}

function init() {
  for (const name of [...SAMPLING, 'system']) {
    const input = $(name);
    input.value = load(name, '');
    input.addEventListener('change', () => save(name, input.value.trim()));
  }
  const key = $('api-key');
  key.value = load('apiKey', '');
  key.addEventListener('change', () => {
    save('apiKey', key.value.trim());
    fetchModel();
  });
  $('reset-settings').addEventListener('click', () => {
    for (const name of [...SAMPLING, 'system']) {
      $(name).value = '';
      save(name, '');
    }
  });
  $('toggle-settings').addEventListener('click', () => showSettings($('settings').hidden));
  $('new-chat').addEventListener('click', newChat);
  $('stop').addEventListener('click', () => state.busy && state.busy.abort());
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Escape' && state.busy) state.busy.abort();
  });
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    const text = $('prompt').value.trim();
    if (!text || state.busy) return;
    $('prompt').value = '';
    send(text);
  });
  $('prompt').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $('composer').requestSubmit();
    }
  });
  fetchModel();
  $('prompt').focus();
}

init();
