// collab-projector viewer: reads the projection API of the server that served it.
//
// Hydration (docs/ui.md): every view (role, debug, work session) is loaded as a snapshot from
// /api/events, then followed live from the snapshot's `next` cursor over /api/events/stream. When
// the stream drops, it reconnects with Last-Event-ID set to the last event applied, so nothing is
// lost or shown twice. Every load carries a generation number; a result that arrives after the
// user switched views belongs to an older generation and is dropped, never drawn. A load that
// fails because the server or its NATS is down is retried until it succeeds (the status says so
// meanwhile); once the stream is back after an outage, the view is loaded again. Rows are ordered
// by event time, newest first.
'use strict';

const ROLES = ['conversation.main', 'delegation.subagent', 'orchestration.task', 'system.observability'];
const TURN_ROLES = new Set(['conversation.main', 'delegation.subagent']);
const DEBUG_TYPES = ['a2a.send', 'a2a.response', 'a2a.complete', 'a2a.response.suppressed'];
// Suppressed replies are system.observability events: the debug view reads that role too when
// the token may.
const SUPPRESSED_ROLE = 'system.observability';
const RETRY_MIN = 1000;    // first retry of a failed load, ms; doubled up to RETRY_MAX
const RETRY_MAX = 5000;
const SNAPSHOT = 200;      // events loaded per view
const MAX_ROWS = 500;      // rows kept on screen; older ones are dropped from the bottom
const SESSIONS = 30;       // work sessions listed
const MAX_KEYS = 16;       // keys the API reads per request
const TOKEN_KEY = 'collab-projector.token';
const TITLES = {
  'conversation.main': 'Conversations',
  'delegation.subagent': 'Delegation',
  'orchestration.task': 'Tasks',
  'system.observability': 'System',
};

const $ = (id) => document.getElementById(id);

const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || '',
  allowed: [],          // roles this token may read (from /api/me)
  role: 'conversation.main',
  debug: false,
  session: null,        // {id, title, keys} when the timeline is narrowed to one work session
  gen: 0,               // the current view's generation
  abort: null,          // aborts the current view's requests
  seen: new Set(),      // sequences drawn in the current view
  items: new Map(),     // seq -> item, for the detail pane
  repeats: 0,           // events received twice (the API promises none; shown for checking)
  sessionTimer: null,
  startGen: 0,          // the current start (token check); an older one stops retrying
  hasOlder: false,      // whether older events than those shown exist (Load older)
  extraRows: 0,         // rows loaded with Load older, kept beyond MAX_ROWS
};

// ---------------------------------------------------------------------------------------------
// Requests

class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || String(status);
  }
}

function headers(extra) {
  const h = Object.assign({ Accept: 'application/json' }, extra || {});
  if (state.token) h.Authorization = `Bearer ${state.token}`;
  return h;
}

async function api(path, signal) {
  const r = await fetch(path, { headers: headers(), signal, cache: 'no-store' });
  const body = await r.json().catch(() => null);
  if (!r.ok) throw new ApiError(r.status, body);
  return body;
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of params) if (v !== undefined && v !== null && v !== '') q.append(k, v);
  return q.toString();
}

// The filters of the current view.
function selection() {
  const params = [['role', state.role]];
  if (showsSuppressed()) params.push(['role', SUPPRESSED_ROLE]);
  let types = [];
  if (TURN_ROLES.has(state.role)) types = state.debug ? DEBUG_TYPES : ['a2a.response'];
  if (types.length) params.push(['type', types.join(',')]);
  if (state.session) for (const k of state.session.keys) params.push(['key', k]);
  return params;
}

// Whether the debug view adds the suppressed replies (another role, when granted).
function showsSuppressed() {
  return state.debug && TURN_ROLES.has(state.role) && state.allowed.includes(SUPPRESSED_ROLE);
}

// A failure worth retrying: the server or its NATS is down or unreachable (not a refusal).
function transient(e) {
  return !(e instanceof ApiError) || e.status >= 500 || e.status === 429 || e.status === 408;
}

// Server-Sent Events over fetch (so the token travels in a header, and Last-Event-ID is ours).
async function* sseFrames(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let m;
    while ((m = /\r?\n\r?\n/.exec(buf)) !== null) {
      const block = buf.slice(0, m.index);
      buf = buf.slice(m.index + m[0].length);
      const frame = { id: null, event: 'message', data: [] };
      for (const line of block.split(/\r?\n/)) {
        if (!line || line.startsWith(':')) continue;
        const i = line.indexOf(':');
        const field = i < 0 ? line : line.slice(0, i);
        let v = i < 0 ? '' : line.slice(i + 1);
        if (v.startsWith(' ')) v = v.slice(1);
        if (field === 'data') frame.data.push(v);
        else if (field === 'id') frame.id = v;
        else if (field === 'event') frame.event = v;
      }
      if (frame.data.length || frame.id) yield { id: frame.id, event: frame.event, data: frame.data.join('\n') };
    }
  }
}

const sleep = (ms, signal) => new Promise((resolve) => {
  const t = setTimeout(resolve, ms);
  signal.addEventListener('abort', () => { clearTimeout(t); resolve(); }, { once: true });
});

// ---------------------------------------------------------------------------------------------
// Status

function setStatus(kind, text) {
  const s = $('status');
  s.dataset.state = kind;
  s.textContent = text;
}

function showDown(e, delay) {
  setStatus('down', `Server unavailable (${e.message}); retrying in ${Math.round(delay / 1000)} s. Nothing published meanwhile is lost.`);
}

function showError(e) {
  if (e instanceof ApiError && e.status === 401) {
    setStatus('token', 'This server has access control on: enter an access token above.');
    $('token').focus();
  } else if (e instanceof ApiError && e.status === 403) {
    setStatus('error', `Not allowed: ${e.message}`);
  } else {
    setStatus('error', `Could not load: ${e.message}`);
  }
}

// ---------------------------------------------------------------------------------------------
// Loading a view: snapshot, then live

async function start() {
  const gen = ++state.startGen;
  let delay = RETRY_MIN;
  for (;;) {
    try {
      const me = await api('/api/me');
      state.allowed = ROLES.filter((r) => (me.roles || []).includes(r));
      break;
    } catch (e) {
      if (gen !== state.startGen) return;
      if (!transient(e)) {
        state.allowed = [];
        drawRoles();
        stopView();
        clearTimeline();
        showError(e);
        return;
      }
      showDown(e, delay);
      await new Promise((resolve) => setTimeout(resolve, delay));
      if (gen !== state.startGen) return;
      delay = Math.min(delay * 2, RETRY_MAX);
    }
  }
  if (gen !== state.startGen) return;
  if (!state.allowed.includes(state.role)) state.role = state.allowed[0] || state.role;
  drawRoles();
  if (!state.allowed.length) {
    setStatus('error', 'This token may read no role.');
    return;
  }
  loadView();
  // A shared address opens its thread or search.
  const thread = threadFromHash();
  if (thread) showThread(thread.key, thread.item);
  const search = searchFromHash();
  if (search !== null) showSearch(search);
}

function stopView() {
  state.gen += 1;
  if (state.abort) state.abort.abort();
  state.abort = null;
  clearInterval(state.sessionTimer);
}

function loadView() {
  stopView();
  const gen = state.gen;
  const ctl = new AbortController();
  state.abort = ctl;
  clearTimeline();
  clearDetail();
  drawHeading();
  setStatus('loading', 'Loading…');
  const sel = selection();
  hydrate(gen, ctl, sel);
  loadSessions(gen, ctl);
  loadWaiting(gen, ctl);
  state.sessionTimer = setInterval(() => { loadSessions(gen, ctl); loadWaiting(gen, ctl); }, 5000);
}

async function hydrate(gen, ctl, sel) {
  let page;
  let delay = RETRY_MIN;
  for (;;) {
    try {
      page = await api(`/api/events?${query([...sel, ['limit', SNAPSHOT]])}`, ctl.signal);
      break;
    } catch (e) {
      if (gen !== state.gen || ctl.signal.aborted) return;
      if (!transient(e)) {
        showError(e);
        return;
      }
      showDown(e, delay);
      await sleep(delay, ctl.signal);
      if (gen !== state.gen || ctl.signal.aborted) return;
      delay = Math.min(delay * 2, RETRY_MAX);
    }
  }
  if (gen !== state.gen) return; // the user switched views meanwhile
  for (const item of page.events) addItem(item);
  state.hasOlder = Boolean(page.prev);
  drawOlder();
  updateEmpty();
  follow(gen, ctl, sel, page.next);
}

async function follow(gen, ctl, sel, cursor) {
  let last = cursor;
  let delay = 500;
  let dropped = false;
  while (gen === state.gen && !ctl.signal.aborted) {
    let note = 'the server closed the stream';
    let renew = false;
    try {
      const r = await fetch(`/api/events/stream?${query(sel)}`, {
        headers: headers({ Accept: 'text/event-stream', 'Last-Event-ID': last }),
        signal: ctl.signal,
        cache: 'no-store',
      });
      if (!r.ok) {
        const err = new ApiError(r.status, await r.json().catch(() => null));
        if (r.status === 410) {
          // Older than retention, or past the newest event of a stream made again: start again
          // from a fresh snapshot.
          if (gen === state.gen) loadView();
          return;
        }
        throw err;
      }
      if (gen !== state.gen) return;
      if (dropped) {
        // Back after an outage: load the view again (the list, its sessions and the stream), so
        // nothing shown depends on what the page held while the server was away.
        loadView();
        return;
      }
      setStatus('live', `Live: ${TITLES[state.role]}${state.debug ? ' (debug)' : ''}`);
      delay = 500;
      for await (const f of sseFrames(r.body)) {
        if (gen !== state.gen) return;
        if (f.event === 'error') {
          const e = (JSON.parse(f.data || '{}').error) || {};
          if (e.code === 'version_switched') {
            // The API serves another projection version now: its cursors are positions in
            // another stream, so load the view afresh.
            if (gen === state.gen) loadView();
            return;
          }
          if (e.resumeFrom) last = e.resumeFrom;
          // The stream's planned end (http.sse_max_stream_lifetime): resume at once where it
          // stopped, keeping what is shown.
          renew = e.code === 'lifetime_reached';
          note = e.message || note;
          break;
        }
        if (f.data) {
          addItem(JSON.parse(f.data));
          updateEmpty();
        }
        if (f.id) last = f.id;
      }
    } catch (e) {
      if (ctl.signal.aborted || gen !== state.gen) return;
      if (e instanceof ApiError && (e.status === 401 || e.status === 403 || e.status === 400)) {
        showError(e);
        return;
      }
      note = e.message;
    }
    if (gen !== state.gen) return;
    if (renew) continue;
    dropped = true;
    setStatus('reconnecting', `Reconnecting (${note}); resuming after the last event shown…`);
    await sleep(delay, ctl.signal);
    delay = Math.min(delay * 2, 5000);
  }
}

// ---------------------------------------------------------------------------------------------
// The timeline

function clearTimeline() {
  $('events').replaceChildren();
  state.seen = new Set();
  state.items = new Map();
  state.repeats = 0;
  state.hasOlder = false;
  state.extraRows = 0;
  document.body.dataset.repeats = '0';
  $('timeline-note').textContent = '';
  $('older-note').textContent = '';
  drawOlder();
  updateEmpty();
}

function drawOlder() {
  $('load-older').hidden = !state.hasOlder;
}

// Older rows than those shown: the page of events before the oldest (in stream order) on screen,
// kept beside the newest MAX_ROWS.
async function loadOlder() {
  const gen = state.gen;
  const ctl = state.abort;
  let oldest = null;
  for (const item of state.items.values()) if (!oldest || item.seq < oldest.seq) oldest = item;
  if (!oldest || !ctl) return;
  const button = $('load-older');
  button.disabled = true;
  try {
    const page = await api(`/api/events?${query([...selection(), ['limit', SNAPSHOT], ['before', oldest.cursor]])}`, ctl.signal);
    if (gen !== state.gen) return;
    state.extraRows += page.events.length;
    for (const item of page.events) addItem(item);
    state.hasOlder = Boolean(page.prev);
    $('older-note').textContent = `${page.events.length} older event(s) loaded.${state.hasOlder ? '' : ' Nothing older is kept.'}`;
  } catch (e) {
    if (gen === state.gen) $('older-note').textContent = `Older events could not be loaded: ${e.message}`;
  } finally {
    button.disabled = false;
    drawOlder();
    updateEmpty();
  }
}

function updateEmpty() {
  $('empty').hidden = $('events').children.length > 0;
}

function drawHeading() {
  const title = TITLES[state.role] || state.role;
  $('timeline-heading').textContent = state.session ? `${title}: ${state.session.title}` : title;
  let what;
  if (!TURN_ROLES.has(state.role)) what = `Every ${state.role} event, newest first.`;
  else if (state.debug && showsSuppressed()) what = `Every send, response and complete of ${state.role}, and every suppressed reply (${SUPPRESSED_ROLE}), newest first.`;
  else if (state.debug) what = `Every send, response and complete of ${state.role}, newest first. Suppressed replies are ${SUPPRESSED_ROLE} events, which this access token may not read.`;
  else what = `One row per turn: its single response, or the blocked outcome that stands in for it. Newest first.`;
  $('timeline-note').textContent = what;
}

function addItem(item) {
  if (state.seen.has(item.seq)) {
    state.repeats += 1;
    document.body.dataset.repeats = String(state.repeats);
    return;
  }
  state.seen.add(item.seq);
  state.items.set(item.seq, item);
  const list = $('events');
  const row = drawRow(item);
  // Newest first by event time; events of the same time in stream order.
  let before = list.firstElementChild;
  while (before && newer(before, row)) before = before.nextElementSibling;
  list.insertBefore(row, before);
  while (list.children.length > MAX_ROWS + state.extraRows) {
    const gone = list.lastElementChild;
    state.items.delete(Number(gone.dataset.seq));
    state.seen.delete(Number(gone.dataset.seq));
    gone.remove();
    // What was dropped can be loaded again.
    state.hasOlder = true;
    drawOlder();
  }
}

// The time a row is ordered by: the event's time, else when it was stored.
function eventTime(item) {
  const ev = item.event || {};
  const t = Date.parse(ev.timestamp || item.storedAt || '');
  return Number.isNaN(t) ? 0 : t;
}

// Whether row `a` goes above row `b` (later event time; at the same time, later in the stream).
function newer(a, b) {
  const ta = Number(a.dataset.time);
  const tb = Number(b.dataset.time);
  return ta !== tb ? ta > tb : Number(a.dataset.seq) > Number(b.dataset.seq);
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== undefined && c !== null && c !== '') e.append(c);
  return e;
}

function messageText(m) {
  if (m === undefined || m === null) return '';
  if (typeof m === 'string') return m;
  if (Array.isArray(m.parts)) {
    return m.parts.map((p) => (typeof p.text === 'string' ? p.text : '')).filter(Boolean).join(' ');
  }
  if (typeof m.text === 'string') return m.text;
  return '';
}

function short(v, n) {
  const s = typeof v === 'string' ? v : JSON.stringify(v);
  if (!s) return '';
  return s.length > n ? `${s.slice(0, n - 1)}…` : s;
}

function clock(iso) {
  if (!iso) return null;
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return null;
  // The time of day for today's events; the date too for any other day's.
  const today = d.toDateString() === new Date().toDateString();
  return el('time', { datetime: iso, title: iso }, today ? d.toLocaleTimeString() : d.toLocaleString());
}

// A UUID-like id is shown by its first 8 characters (the whole id is in the row's title and in
// the detail pane); other ids as they are.
function shortId(id) {
  return /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i.test(id) ? `${id.slice(0, 8)}…` : id;
}

function isBlocked(ev) {
  return ev.type === 'a2a.response' && ev.payload && ev.payload.outcome === 'blocked';
}

function summary(ev) {
  const p = ev.payload || {};
  if (ev.type === 'a2a.response.suppressed') {
    return `Not published as a response (${p.reason || 'suppressed'}): the turn already has one.`;
  }
  if (ev.type.startsWith('a2a.')) return messageText(p.message) || short(p.text || '', 400);
  if (p.title || p.status) return [p.title, p.status && `status ${p.status}`, p.progress !== undefined && `progress ${short(p.progress, 20)}`].filter(Boolean).join(' · ');
  if (typeof p.delta === 'string') return p.delta;
  if (typeof p.content === 'string') return short(p.content, 300);
  return Object.keys(p).length ? short(p, 200) : '';
}

function drawRow(item) {
  const ev = item.event || {};
  const p = ev.payload || {};
  const blocked = isBlocked(ev);
  const turn = ev.turnId || p.turn;
  const from = p.fromAgent || ev.agentId;
  const to = p.toAgent;
  // A response row says who asked whom: the asker is the response's addressee.
  const response = ev.type === 'a2a.response';
  let who = from;
  if (from && to) who = response ? `${to} asked ${from}` : `${from} → ${to}`;
  const waiting = response && !blocked && (p.state === 'input-required' || p.state === 'auth-required');
  const head = el('span', { class: 'head' },
    clock(ev.timestamp || item.storedAt),
    who ? el('span', { class: 'who' }, who) : null,
    (state.debug || !TURN_ROLES.has(state.role) || ev.type !== 'a2a.response') ? el('span', { class: 'type' }, ev.type) : null,
    blocked ? el('span', { class: 'badge blocked' }, `Blocked: ${p.reason || 'unknown'}`) : null,
    waiting ? el('span', { class: 'badge waiting' }, `Waiting for ${p.state === 'auth-required' ? 'credentials' : 'input'} from ${to || 'the caller'}`) : null,
    ev.type === 'a2a.response.suppressed' ? el('span', { class: 'badge suppressed' }, `Suppressed: ${p.reason || ''}`) : null,
    turn ? el('span', {}, `turn ${shortId(String(turn))}`) : null,
    ev.conversationId ? el('span', { title: String(ev.conversationId) }, shortId(String(ev.conversationId))) : null);
  const body = [head];
  if (blocked) {
    const dl = el('dl', { class: 'blocked-detail' });
    for (const [label, value] of [['Reason', p.reason], ['Goal', p.goal], ['Next action', p.next_action]]) {
      if (value) dl.append(el('dt', {}, label), el('dd', {}, String(value)));
    }
    body.push(dl);
  } else if (ev.type === 'a2a.response' && typeof p.goal === 'string' && typeof p.outcome === 'string') {
    // A reply in the handoff form: its four sections, as the producer wrote them.
    const dl = el('dl', { class: 'handoff' });
    for (const [label, value] of [['Goal', p.goal], ['Outcome', p.outcome], ['Evidence', p.evidence], ['Next action', p.next_action]]) {
      if (value !== undefined && value !== null && value !== '') dl.append(el('dt', {}, label), el('dd', {}, short(value, 600)));
    }
    body.push(dl);
  } else {
    const text = summary(ev);
    if (text) body.push(el('span', { class: 'text' }, text));
  }
  // The row's visible text is its accessible name; selecting it fills the detail pane.
  const button = el('button', { type: 'button', 'aria-controls': 'detail' }, ...body);
  button.addEventListener('click', () => select(item.seq, button));
  return el('li', {
    class: `row${blocked ? ' blocked' : ''}`,
    'data-seq': item.seq,
    'data-time': eventTime(item),
    'data-type': ev.type,
    'data-key': item.key,
    'data-turn': turn,
    'data-outcome': blocked ? 'blocked' : (waiting ? 'waiting' : null),
    'data-reason': blocked ? p.reason : null,
  }, button);
}

// ---------------------------------------------------------------------------------------------
// The detail pane

function clearDetail() {
  const box = $('detail-body');
  box.replaceChildren();
  box.hidden = true;
  $('detail-empty').hidden = false;
  $('detail-heading').textContent = 'Event';
}

function blobRefs(v, out) {
  if (Array.isArray(v)) v.forEach((x) => blobRefs(x, out));
  else if (v && typeof v === 'object') {
    if (typeof v.$ref === 'string' && v.$ref.startsWith('blob:')) out.push(v.$ref.slice(5));
    else Object.values(v).forEach((x) => blobRefs(x, out));
  }
  return out;
}

function select(seq, button) {
  const item = state.items.get(seq);
  if (!item) return;
  for (const b of document.querySelectorAll('.row > button[aria-current]')) b.removeAttribute('aria-current');
  button.setAttribute('aria-current', 'true');
  const ev = item.event || {};
  const box = $('detail-body');
  const ids = el('dl');
  const add = (dl, k, v) => { if (v !== undefined && v !== null && v !== '') dl.append(el('dt', {}, k), el('dd', {}, typeof v === 'string' ? v : JSON.stringify(v))); };
  add(ids, 'type', ev.type);
  add(ids, 'role', ev.eventRole || item.role);
  add(ids, 'cursor', item.cursor);
  add(ids, 'subject', item.subject);
  for (const k of ['timestamp', 'conversationId', 'workSessionId', 'turnId', 'messageId', 'taskId', 'runId', 'sessionId', 'threadId', 'agentId', 'phase', 'redactions']) add(ids, k, ev[k]);
  const parts = [el('h3', {}, 'Envelope'), ids];
  if (ev.refs) parts.push(el('h3', {}, 'refs'), el('pre', {}, JSON.stringify(ev.refs, null, 2)));
  const raw = ev.rawEventRef;
  if (raw) {
    const rdl = el('dl');
    add(rdl, 'stream', raw.stream);
    add(rdl, 'seq', raw.seq);
    add(rdl, 'subject', raw.subject);
    add(rdl, 'storedAt', raw.storedAt);
    parts.push(el('h3', {}, 'rawEventRef'), rdl);
  }
  const blobs = blobRefs(ev.payload, []);
  if (ev.payload !== undefined) parts.push(el('h3', {}, 'payload'), el('pre', {}, JSON.stringify(ev.payload, null, 2)));
  for (const id of blobs) {
    const out = el('pre', { hidden: true });
    const b = el('button', { type: 'button' }, `Load offloaded field ${id.slice(0, 12)}…`);
    b.addEventListener('click', async () => {
      try {
        const r = await fetch(`/api/blobs/${encodeURIComponent(id)}`, { headers: headers({ Accept: '*/*' }) });
        out.textContent = r.ok ? await r.text() : `HTTP ${r.status}: ${short(await r.text(), 300)}`;
      } catch (e) {
        out.textContent = `Could not load: ${e.message}`;
      }
      out.hidden = false;
    });
    parts.push(b, out);
  }
  if (item.key) {
    const open = el('button', { type: 'button', id: 'open-thread' }, 'Show this thread as runs and turns');
    open.addEventListener('click', () => showThread(item.key));
    parts.unshift(open);
  }
  box.replaceChildren(...parts);
  box.hidden = false;
  $('detail-empty').hidden = true;
  $('detail-heading').textContent = `Event ${ev.type}`;
}

// ---------------------------------------------------------------------------------------------
// A thread as people read it (/api/threads/{key}): runs with their messages assembled from the
// deltas and their tool calls, turns with the reply in place. Its address (#thread=<key>) can
// be shared.

function duration(ms) {
  if (ms === undefined || ms === null) return '';
  return ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(1)} s`;
}

// A rolled-up total: tokens, their cost, and the tokens of models without a price.
function totalText(t) {
  if (!t || !(t.inputTokens || t.outputTokens)) return '';
  const n = (x) => Number(x || 0).toLocaleString('en');
  let text = `${n(t.inputTokens)} in · ${n(t.outputTokens)} out tokens`;
  if (t.cost > 0) text += ` · cost ${t.cost.toFixed(4)}`;
  if (t.unpricedTokens) text += ` (${n(t.unpricedTokens)} unpriced)`;
  return text;
}

function usageText(u) {
  if (!u) return '';
  const cost = u.cost !== undefined && u.cost !== null ? ` · cost ${u.cost.toFixed(4)}` : '';
  return `${u.inputTokens.toLocaleString('en')} in · ${u.outputTokens.toLocaleString('en')} out tokens${u.model ? ` (${u.model})` : ''}${cost}`;
}

function runView(r) {
  const waiting = r.outcome === 'waiting' ? ` for ${r.waitingFor || 'input'}${r.waitingOn ? ` on ${r.waitingOn}` : ''}` : '';
  const head = [r.agent || 'agent', `run ${r.runId}`, `${r.outcome.replace('_', ' ')}${waiting}`, duration(r.durationMs), usageText(r.usage)]
    .filter(Boolean).join(' · ');
  const items = [el('h3', {}, head)];
  if (r.parentRunId) items.push(el('p', { class: 'meta' }, `started by run ${r.parentRunId}`));
  if (r.error) items.push(el('p', { class: 'meta' }, `Error: ${r.error}`));
  for (const m of r.messages) {
    items.push(el('p', { class: 'message', 'data-message': m.messageId },
      el('strong', {}, `${m.role || 'message'}: `), m.text + (m.complete ? '' : ' …')));
  }
  for (const c of r.toolCalls) {
    const res = c.result !== undefined ? ` → ${short(c.result, 300)}` : '';
    items.push(el('p', { class: 'tool', 'data-tool': c.toolCallId },
      el('code', {}, `${c.name || 'tool'}(${short(c.arguments, 300)})`),
      `${res} · ${c.status}${c.durationMs !== undefined ? ` · ${duration(c.durationMs)}` : ''}`));
  }
  for (const st of r.steps) items.push(el('p', { class: 'meta' }, `step ${st.name}`));
  return el('section', { class: 'run', 'data-run': r.runId, 'data-outcome': r.outcome }, ...items);
}

function turnView(t) {
  const who = `${t.fromAgent || '?'} → ${t.toAgent || '?'}`;
  const outcome = t.outcome === 'blocked' ? `blocked: ${t.reason || ''}` : t.outcome.replace('_', ' ');
  const items = [el('h3', {}, [who, outcome, duration(t.durationMs), usageText(t.usage)].filter(Boolean).join(' · '))];
  if (t.request) items.push(el('p', { class: 'message' }, el('strong', {}, `${t.fromAgent || 'asked'}: `), t.request));
  if (t.reply) items.push(el('p', { class: 'message' }, el('strong', {}, `${t.toAgent || 'answer'}: `), t.reply));
  return el('section', { class: 'turn', 'data-turn': t.turnId, 'data-outcome': t.outcome }, ...items);
}

// The address of a thread, or of one run (`run:<id>`) or turn (`turn:<id>`) in it.
function threadLink(key, item) {
  return `#thread=${encodeURIComponent(key)}${item ? `&item=${encodeURIComponent(item)}` : ''}`;
}

async function showThread(key, item) {
  const box = $('detail-body');
  $('detail-heading').textContent = `Thread ${key}`;
  box.replaceChildren(el('p', { class: 'note' }, 'Loading…'));
  box.hidden = false;
  $('detail-empty').hidden = true;
  if (location.hash !== threadLink(key, item)) history.replaceState(null, '', threadLink(key, item));
  let body;
  try {
    body = await api(`/api/threads/${encodeURIComponent(key)}`);
  } catch (e) {
    box.replaceChildren(el('p', { class: 'note' }, `The thread could not be loaded: ${e.message}`));
    return;
  }
  const t = body.thread;
  const parts = [el('p', { class: 'meta' }, `${t.runs.length} run(s), ${t.turns.length} turn(s) from ${t.events} events${t.truncated ? ' (the newest; older ones exist)' : ''}.`)];
  const total = totalText(t.total);
  if (total) parts.push(el('p', { class: 'total', id: 'thread-total' }, `Total: ${total}`));
  parts.push(treeBox(key, null, 'thread-tree', 'Delegation tree of this thread'));
  parts.push(...runTree(t.runs), ...t.turns.map(turnView));
  box.replaceChildren(...parts);
  // Every run and turn links to itself; a linked one is marked and scrolled to.
  for (const sec of box.querySelectorAll('section.run, section.turn')) {
    const id = sec.classList.contains('run') ? `run:${sec.dataset.run}` : `turn:${sec.dataset.turn}`;
    sec.querySelector('h3').append(' ', el('a', { href: threadLink(key, id), class: 'permalink', 'aria-label': `Link to ${id}` }, 'link'));
    sec.querySelector('h3').after(treeBox(key, id, null, `Delegation tree of ${id}`));
    if (id === item) {
      sec.classList.add('linked');
      sec.setAttribute('aria-current', 'true');
      sec.scrollIntoView({ block: 'nearest' });
    }
  }
}

// Runs nested under the run that started them (parentRunId), each child in an expandable
// section with its duration and outcome; runs whose parent is not in the thread are roots.
function runTree(runs) {
  const ids = new Set(runs.map((r) => r.runId));
  const children = new Map();
  for (const r of runs) {
    if (r.parentRunId && ids.has(r.parentRunId) && r.parentRunId !== r.runId) {
      if (!children.has(r.parentRunId)) children.set(r.parentRunId, []);
      children.get(r.parentRunId).push(r);
    }
  }
  const seen = new Set();
  const draw = (r) => {
    seen.add(r.runId);
    const node = runView(r);
    for (const c of children.get(r.runId) || []) {
      if (seen.has(c.runId)) continue;
      const label = `${c.agent || 'agent'} · run ${c.runId} · ${c.outcome.replace('_', ' ')}${c.durationMs !== undefined ? ` · ${duration(c.durationMs)}` : ''}`;
      node.append(el('details', { class: 'child', open: 'open', 'data-child': c.runId }, el('summary', {}, label), draw(c)));
    }
    return node;
  };
  return runs.filter((r) => !(r.parentRunId && ids.has(r.parentRunId) && r.parentRunId !== r.runId)).map(draw);
}

// ---------------------------------------------------------------------------------------------
// The delegation tree (/api/tree/{key}?item=): what a thread, run or turn caused across
// conversations, as nested <details>, each node with its start, duration, outcome and the tokens
// and cost rolled up from below.

function treeBox(key, item, id, label) {
  const box = el('div', { class: 'tree', id });
  const b = el('button', { type: 'button', class: 'tree-open' }, label);
  b.addEventListener('click', () => loadTree(box, key, item));
  box.append(b);
  return box;
}

async function loadTree(box, key, item) {
  box.replaceChildren(el('p', { class: 'note' }, 'Loading the delegation tree…'));
  let body;
  try {
    body = await api(`/api/tree/${encodeURIComponent(key)}${item ? `?${query([['item', item]])}` : ''}`);
  } catch (e) {
    box.replaceChildren(el('p', { class: 'note' }, `The delegation tree could not be loaded: ${e.message}`));
    return;
  }
  const cut = body.truncated || !body.scanComplete ? ' Some links may be missing (a bound was reached).' : '';
  box.replaceChildren(
    el('p', { class: 'meta' }, `${body.keys.length} conversation(s), ${body.events} events.${cut}`),
    treeNode(body.tree, true));
}

function treeNode(n, top) {
  const when = n.startedAt ? new Date(n.startedAt) : null;
  const start = when && !Number.isNaN(when.getTime()) ? `started ${when.toLocaleTimeString()}` : '';
  const outcome = n.outcome.replace('_', ' ');
  const head = [`${n.kind} ${n.label}`, outcome, start, duration(n.durationMs), totalText(n.total)].filter(Boolean).join(' · ');
  const attrs = { 'data-kind': n.kind, 'data-id': n.id, 'data-outcome': n.outcome };
  const link = n.item ? el('a', { href: threadLink(n.key, n.item), class: 'permalink', 'aria-label': `Open ${n.item} of ${n.key}` }, 'open') : null;
  if (!n.children.length) return el('div', Object.assign({ class: 'leaf' }, attrs), head, link ? ' ' : '', link);
  // The link stays out of the summary: a summary is itself the control that opens the node.
  const d = el('details', Object.assign({ class: 'node' }, attrs), el('summary', {}, head));
  if (link) d.append(el('div', { class: 'leaf' }, link));
  if (top) d.open = true;
  for (const c of n.children) d.append(treeNode(c, false));
  return d;
}

function threadFromHash() {
  const m = /^#thread=([^&]+)(?:&item=(.+))?$/.exec(location.hash);
  return m ? { key: decodeURIComponent(m[1]), item: m[2] ? decodeURIComponent(m[2]) : null } : null;
}

// ---------------------------------------------------------------------------------------------
// Search (/api/search): by text, agent, outcome and time, over every role the token may read;
// the results go to the detail pane, each opening its thread. Its address (#search=<query>) can
// be shared.

function searchQuery() {
  const since = $('search-since').value;
  return query([
    ['q', $('search-q').value.trim()],
    ['agent', $('search-agent').value.trim()],
    ['outcome', $('search-outcome').value],
    ['since', since ? new Date(since).toISOString() : ''],
  ]);
}

async function showSearch(qs) {
  const box = $('detail-body');
  $('detail-heading').textContent = 'Search results';
  box.replaceChildren(el('p', { class: 'note' }, 'Searching…'));
  box.hidden = false;
  $('detail-empty').hidden = true;
  if (location.hash !== `#search=${encodeURIComponent(qs)}`) history.replaceState(null, '', `#search=${encodeURIComponent(qs)}`);
  let body;
  try {
    body = await api(`/api/search?${qs}`);
  } catch (e) {
    box.replaceChildren(el('p', { class: 'note' }, `The search failed: ${e.message}`));
    return;
  }
  const list = el('ul', { class: 'results' }, ...body.events.map((item) => {
    const ev = item.event || {};
    const b = el('button', { type: 'button', 'data-key': item.key },
      el('span', { class: 'meta' }, [ev.timestamp || item.storedAt, ev.type, item.key].filter(Boolean).join(' · ')),
      el('span', { class: 'text' }, short(summary(ev) || '', 200)));
    b.addEventListener('click', () => showThread(item.key));
    return el('li', {}, b);
  }));
  const more = body.prev ? ' More may match further back.' : '';
  box.replaceChildren(el('p', { class: 'meta', id: 'search-count' }, `${body.count} event(s) found in ${body.scanned} read.${more}`), list);
}

function searchFromHash() {
  const m = /^#search=(.*)$/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

// ---------------------------------------------------------------------------------------------
// Waiting (/api/waiting): every turn and run waiting now, longest first, each linking to its
// thread item.

async function loadWaiting(gen, ctl) {
  let body;
  try {
    body = await api('/api/waiting?limit=50', ctl.signal);
  } catch (e) {
    if (gen === state.gen && !ctl.signal.aborted) $('waiting-note').textContent = `Waits could not be loaded: ${e.message}`;
    return;
  }
  if (gen !== state.gen) return;
  const more = body.total > body.count ? ` (the ${body.count} longest of ${body.total})` : '';
  $('waiting-note').textContent = body.count ? `${body.count} waiting${more}, longest first.` : 'Nothing is waiting.';
  replaceIfChanged($('waiting'), JSON.stringify(body.waits), () => body.waits.map((w) => {
    const since = new Date(w.since);
    const when = Number.isNaN(since.getTime()) ? w.since : since.toLocaleString();
    const who = `${w.who || 'someone'} waits${w.on ? ` on ${w.on}` : ''} for ${w.for}`;
    const a = el('a', { href: threadLink(w.key, w.item), 'data-item': w.item, 'data-key': w.key },
      el('span', { class: 'title' }, who),
      el('span', { class: 'meta' }, `since ${when} · ${w.kind} ${shortId(w.item.slice(w.item.indexOf(':') + 1))} · ${w.key}`),
      w.prompt ? el('span', { class: 'meta' }, short(w.prompt, 160)) : null);
    return el('li', {}, a);
  }));
}

// Replace `list`'s items, built by `items()`, only when what they show (`signature`) changed:
// the refresh every few seconds then keeps the keyboard focus, and the element a reader is
// about to click, whenever nothing changed. The signatures are kept here, not in the page.
const drawnSignatures = new WeakMap();
function replaceIfChanged(list, signature, items) {
  if (drawnSignatures.get(list) === signature) return;
  list.replaceChildren(...items());
  drawnSignatures.set(list, signature);
}

// ---------------------------------------------------------------------------------------------
// Work sessions

async function loadSessions(gen, ctl) {
  let body;
  try {
    body = await api(`/api/work-sessions?${query([['role', state.role], ['limit', SESSIONS]])}`, ctl.signal);
  } catch (e) {
    if (gen === state.gen && !ctl.signal.aborted) $('sessions-note').textContent = `Work sessions could not be loaded: ${e.message}`;
    return;
  }
  if (gen !== state.gen) return;
  const pressedId = state.session ? state.session.id : null;
  replaceIfChanged($('sessions'), JSON.stringify([pressedId, body.sessions]), () => body.sessions.map((s) => {
    const who = (s.participants || []).map((p) => p.id).join(', ');
    const pressed = pressedId === s.id;
    const b = el('button', { type: 'button', 'aria-pressed': pressed ? 'true' : 'false', 'data-session': s.id },
      el('span', { class: 'title' }, s.title || s.id),
      el('span', { class: 'meta' }, `${s.id} · ${s.status}`),
      el('span', { class: 'meta' }, `${s.openTurns} open · ${s.blockedTurns} blocked · ${s.answeredTurns ?? 0} answered turns`),
      usageLine(s),
      who ? el('span', { class: 'meta' }, who) : null);
    b.addEventListener('click', () => pickSession(s));
    return el('li', {}, b);
  }));
  let note = `${body.count} of ${body.totalMatched ?? body.count} sessions with ${state.role} events, most recently active first.`;
  if (body.behind > 0) note += ` Written up to projection ${body.foldedTo}: ${Number(body.behind).toLocaleString('en')} newer projections are not in them yet.`;
  $('sessions-note').textContent = note;
}

// Tokens and cost of a session (the cost comes from the server's price table; models without a
// price are counted in tokens only).
function usageLine(s) {
  const t = s.usageTotal;
  if (!t || !(t.inputTokens || t.outputTokens)) return null;
  const n = (x) => Number(x || 0).toLocaleString('en');
  let text = `${n(t.inputTokens)} in · ${n(t.outputTokens)} out tokens`;
  if (t.cost > 0) text += ` · cost ${t.cost.toFixed(4)}`;
  if (t.unpricedTokens) text += ` (${n(t.unpricedTokens)} unpriced)`;
  const byAgent = (s.usage || []).map((u) => `${u.agent} ${u.model}: ${n(u.inputTokens)} in, ${n(u.outputTokens)} out${u.cost != null ? `, ${u.cost.toFixed(4)}` : ''}`);
  return el('span', { class: 'meta usage', title: byAgent.join('\n') }, text);
}

function pickSession(s) {
  if (state.session && state.session.id === s.id) {
    clearSession();
    return;
  }
  // The API reads at most 16 keys per request: the session's 16 most recently active
  // conversations (its threads come newest first).
  const keys = [...new Set((s.threads || []).map((t) => t.conversationId).filter(Boolean))].slice(0, MAX_KEYS);
  if (!keys.length) keys.push(s.workSessionId || s.id);
  state.session = { id: s.id, title: s.title || s.id, keys };
  $('session-filter').hidden = false;
  const total = (s.threads || []).length;
  $('session-filter-text').textContent = total > keys.length
    ? `Showing the ${keys.length} most recent of ${total} conversations of “${state.session.title}”.`
    : `Showing ${keys.length} conversation(s) of “${state.session.title}”.`;
  loadView();
}

function clearSession() {
  state.session = null;
  $('session-filter').hidden = true;
  loadView();
}

// ---------------------------------------------------------------------------------------------
// Controls

function drawRoles() {
  for (const input of document.querySelectorAll('#roles input[name="role"]')) {
    const granted = state.allowed.includes(input.value);
    input.disabled = !granted;
    input.checked = input.value === state.role;
    const label = input.closest('label');
    label.classList.toggle('denied', !granted);
    label.title = granted ? '' : 'Not granted to this access token';
  }
}

function init() {
  $('token').value = state.token ? '••••••••' : '';
  $('token-form').addEventListener('submit', (e) => {
    e.preventDefault();
    const v = $('token').value.trim();
    if (v && v !== '••••••••') {
      state.token = v;
      sessionStorage.setItem(TOKEN_KEY, v);
      $('token').value = '••••••••';
    }
    start();
  });
  $('token-forget').addEventListener('click', () => {
    state.token = '';
    sessionStorage.removeItem(TOKEN_KEY);
    $('token').value = '';
    start();
  });
  for (const input of document.querySelectorAll('#roles input[name="role"]')) {
    input.addEventListener('change', () => {
      if (!input.checked) return;
      state.role = input.value;
      state.session = null;
      $('session-filter').hidden = true;
      loadView();
    });
  }
  $('debug').addEventListener('change', (e) => {
    state.debug = e.target.checked;
    loadView();
  });
  $('session-clear').addEventListener('click', clearSession);
  $('load-older').addEventListener('click', loadOlder);
  window.addEventListener('hashchange', () => {
    const thread = threadFromHash();
    if (thread) showThread(thread.key, thread.item);
    const search = searchFromHash();
    if (search !== null) showSearch(search);
  });
  $('search-form').addEventListener('submit', (e) => {
    e.preventDefault();
    showSearch(searchQuery());
  });
  start();
}

document.addEventListener('DOMContentLoaded', init);
