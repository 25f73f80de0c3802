// epd web demo: pick a video, see the frames the encoder samples, ask questions through the
// streaming OpenAI API (/v1/chat/completions, SSE) and draw what the final chunk's `epd` object
// says: stage timings, frames, encoder cache hit, and which visual tokens token dropping kept.
//
// Questions about one clip form a conversation: each request carries the earlier questions and
// answers as OpenAI `messages` (the server keeps no state), the first user turn holding the
// media. "New conversation" (or another clip) starts over. The usage chunk's
// `prompt_tokens_details.cached_tokens` (or `epd.num_reused_prompt_tokens`) says how much of the
// prompt prefill's prefix cache reused.
//
// With the server's --reasoning-parser, a chunk's delta carries the thinking block's text as
// `reasoning` (vLLM's name; `reasoning_content`, its older one, beside it) and the answer as
// `content`: the reasoning streams into a collapsible "Thinking" block above the answer, and the
// conversation keeps the content alone. "token probabilities" asks for logprobs (`logprobs: true`,
// `top_logprobs`): each streamed piece is shaded by its tokens' probability and its tooltip lists
// each token's and the most likely alternatives'.
//
// `epd.kept_tokens` (present only when token dropping ran): kept[t][row][col], 0/1 or booleans,
//   t   = temporal group of the vision tower (Qwen2-VL merges 2 consecutive frames into one group,
//         so frame i belongs to group floor(i * T / num_frames)),
//   row, col = the merged-token grid of that group (2x2 patches of 14 px per token).
// Absent: every token was kept, and the grid is inferred from num_visual_tokens / T tokens per
// group laid out with the frames' aspect ratio.
"use strict";

const TEMPORAL_PATCH = 2;  // frames per temporal group in Qwen2-VL / Qwen2.5-VL
// The stages with a timing, in timeline order: epd.stages.names.TIMED_STAGES (a unit test keeps
// this list equal to it). "video_decode" is decoding the video; "generate" is token generation.
const STAGES = ["video_decode", "encode", "prefill", "kv_transfer", "generate"];
const $ = (id) => document.getElementById(id);
const TOP_LOGPROBS = 5;  // alternatives per token with "token probabilities" on (the server allows 20)

const state = {
  dataUrl: null,   // the chosen media as a data: URL, resent on follow-ups (the encoder's cache hits)
  kind: "video",   // "video" | "image"
  name: "",
  sha256: "",
  frames: null,    // {frames: [{timestamp_s, jpeg_base64}], width, height}
  framesKey: "",   // sampling options the frames were fetched with
  framesLoading: null, // the frames request in flight: {dataUrl, key, controller, done}
  turns: [],       // the conversation so far: [{question, answer}], oldest first
  conversation: 0, // bumped by newConversation(): an answer that ends after it was the old one's
  busy: false,
  answering: null, // AbortController of the answer streaming now: another clip stops its server work
};

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

function mediaOptions() {
  return { num_frames: Math.max(1, parseInt($("num-frames").value, 10) || 8) };
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

// ---- choosing media --------------------------------------------------------------------------

function readAsDataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

async function sha256Hex(blob) {
  if (!(window.crypto && crypto.subtle)) return "";  // not a secure context (plain http off loopback)
  const digest = await crypto.subtle.digest("SHA-256", await blob.arrayBuffer());
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

async function useMedia(blob, name, questions) {
  showError("");
  state.dataUrl = await readAsDataUrl(blob);
  state.kind = (blob.type || "").startsWith("image/") ? "image" : "video";
  state.name = name;
  state.sha256 = await sha256Hex(blob);
  state.frames = null;
  state.framesKey = "";
  newConversation();
  const sha = state.sha256 ? ` · sha256 ${state.sha256.slice(0, 12)}…` : "";
  $("media-info").textContent = `${name} (${state.kind}, ${blob.size.toLocaleString()} bytes)${sha}`;
  showSuggestions(questions || []);
  $("ask").disabled = false;
  await loadFrames();
}

async function loadSamples() {
  const response = await fetch("/demo/samples");
  if (!response.ok) return;
  const { samples } = await response.json();
  const select = $("sample-select");
  for (const s of samples) {
    const option = document.createElement("option");
    option.value = s.name;
    option.textContent = `${s.name} (${s.kind})`;
    option.dataset.questions = JSON.stringify(s.questions);
    select.appendChild(option);
  }
}

async function useSample() {
  const select = $("sample-select");
  const name = select.value;
  if (!name) return;
  const response = await fetch("/demo/samples/" + encodeURIComponent(name));
  if (!response.ok) return showError(await errorMessage(response));
  const questions = JSON.parse(select.selectedOptions[0].dataset.questions || "[]");
  await useMedia(await response.blob(), name, questions);
}

function showSuggestions(questions) {
  const box = $("suggestions");
  box.innerHTML = "";
  for (const q of questions.slice(0, 6)) {
    const chip = document.createElement("button");
    chip.type = "button";
    chip.className = "suggestion";
    chip.textContent = q;
    chip.onclick = () => { $("question").value = q; };
    box.appendChild(chip);
  }
}

// ---- sampled frames and the kept-token overlay ----------------------------------------------

async function loadFrames() {
  // One frames request at a time: for another clip or other options, the one in flight is
  // aborted (its server decode stops and gives its slot back, and its answer cannot land on the
  // new clip); for the same clip and options, callers wait for the one in flight.
  const options = mediaOptions();
  const key = JSON.stringify(options);
  if (!state.dataUrl || key === state.framesKey) return;
  const pending = state.framesLoading;
  if (pending && pending.dataUrl === state.dataUrl && pending.key === key) return pending.done;
  if (pending) pending.controller.abort();
  const loading = { dataUrl: state.dataUrl, key, controller: new AbortController() };
  state.framesLoading = loading;
  loading.done = fetchFrames(loading, options).finally(() => {
    if (state.framesLoading === loading) state.framesLoading = null;
  });
  return loading.done;
}

async function fetchFrames(loading, options) {
  const signal = loading.controller.signal;
  try {
    const response = await fetch("/demo/frames", {
      method: "POST",
      headers: apiHeaders(),
      body: JSON.stringify({ video_url: loading.dataUrl, media: options }),
      signal,
    });
    if (!response.ok) {
      const message = await errorMessage(response);
      if (!signal.aborted) showError("frames: " + message);
      return;
    }
    const frames = await response.json();
    if (signal.aborted) return;
    state.frames = frames;
    state.framesKey = loading.key;
    renderFrames(null);
  } catch (err) {
    if (!signal.aborted) throw err;  // aborted: a newer request took over
  }
}

function tokenGrid(epd, numGroups) {
  // -> {rows, cols} of one temporal group when the server sent no kept_tokens.
  const perGroup = epd ? Math.round(epd.num_visual_tokens / numGroups) : 0;
  const aspect = state.frames.height / state.frames.width;
  if (!perGroup) return null;
  let best = { rows: 1, cols: perGroup }, bestErr = Infinity;
  for (let rows = 1; rows <= perGroup; rows++) {
    if (perGroup % rows) continue;
    const cols = perGroup / rows;
    const err = Math.abs(Math.log(rows / cols / aspect));
    if (err < bestErr) { best = { rows, cols }; bestErr = err; }
  }
  return best;
}

function renderFrames(epd) {
  const box = $("frames");
  box.innerHTML = "";
  if (!state.frames) return;
  const frames = state.frames.frames;
  const kept = epd && Array.isArray(epd.kept_tokens) ? epd.kept_tokens : null;
  const numGroups = kept ? kept.length : Math.max(1, Math.ceil(frames.length / TEMPORAL_PATCH));
  const inferred = kept ? null : tokenGrid(epd, numGroups);
  const flat = kept ? kept.flat(2).map(Boolean) : [];
  const numKept = flat.filter((k) => k).length, numTokens = flat.length;
  frames.forEach((frame, i) => {
    const figure = document.createElement("figure");
    figure.className = "frame";
    const pic = document.createElement("div");
    pic.className = "pic";
    const img = document.createElement("img");
    img.src = "data:image/jpeg;base64," + frame.jpeg_base64;
    img.alt = `frame ${i} at ${frame.timestamp_s.toFixed(2)} s`;
    pic.appendChild(img);
    const group = Math.min(numGroups - 1, Math.floor((i * numGroups) / frames.length));
    const grid = kept ? kept[group] : null;
    const rows = grid ? grid.length : inferred ? inferred.rows : 0;
    const cols = grid ? (grid[0] || []).length : inferred ? inferred.cols : 0;
    if (rows && cols) {
      const overlay = document.createElement("div");
      overlay.className = "token-grid";
      overlay.dataset.group = String(group);
      overlay.style.gridTemplateColumns = `repeat(${cols}, 1fr)`;
      overlay.style.gridTemplateRows = `repeat(${rows}, 1fr)`;
      for (let r = 0; r < rows; r++) {
        for (let c = 0; c < cols; c++) {
          const isKept = grid ? Boolean(grid[r][c]) : true;
          const cell = document.createElement("div");
          cell.className = "token " + (isKept ? "kept" : "dropped");
          overlay.appendChild(cell);
        }
      }
      pic.appendChild(overlay);
    }
    figure.appendChild(pic);
    const caption = document.createElement("figcaption");
    caption.textContent = `#${i} · ${frame.timestamp_s.toFixed(2)} s`;
    figure.appendChild(caption);
    box.appendChild(figure);
  });
  const legend = $("overlay-legend");
  if (!epd) legend.textContent = "(the token overlay appears with the first answer)";
  else if (kept) legend.textContent = `token dropping kept ${numKept} of ${numTokens} visual tokens (dropped ones shaded)`;
  else legend.textContent = `all ${epd.num_visual_tokens} visual tokens kept (token dropping off)`;
}

// ---- the conversation -------------------------------------------------------------------------

function newConversation() {
  // The old clip's answer is of no use any more: stop it, and with it the server's generation.
  if (state.answering) state.answering.abort();
  state.conversation += 1;
  state.turns = [];
  $("answers").innerHTML = "";
  showConversation();
}

function showConversation() {
  const n = state.turns.length;
  $("conversation-info").textContent = n === 0
    ? "new conversation: the next question is the first about this clip"
    : `follow-up: the next question is sent with the ${n} earlier question${n === 1 ? "" : "s"} and answer${n === 1 ? "" : "s"}`;
  $("new-conversation").disabled = n === 0;
}

function conversationMessages(question) {
  // The first user turn is [media, question]: the same prompt as `epd ask` and the SDK's
  // ask(video, question) / client.conversation (the server keeps the parts in this order);
  // then each earlier answer as the assistant's turn, then the new question.
  const mediaType = state.kind === "image" ? "image_url" : "video_url";
  const messages = [];
  for (const [i, turn] of [...state.turns, { question, answer: null }].entries()) {
    const content = [{ type: "text", text: turn.question }];
    if (i === 0) content.unshift({ type: mediaType, [mediaType]: { url: state.dataUrl } });
    messages.push({ role: "user", content });
    if (turn.answer !== null) messages.push({ role: "assistant", content: turn.answer });
  }
  return messages;
}

// ---- asking: the streaming OpenAI API ---------------------------------------------------------

async function ask(question) {
  // Another clip can be chosen while this answer streams (it starts a new conversation): the
  // answer must then not join the new clip's turns nor draw on its frames.
  const conversation = state.conversation;
  const card = $("answer-template").content.firstElementChild.cloneNode(true);
  const turn = state.turns.length + 1;
  card.dataset.turn = String(turn);
  card.querySelector(".q").textContent = (turn > 1 ? `#${turn} · ` : "") + question;
  const text = card.querySelector(".answer-text");
  $("answers").prepend(card);
  const body = {
    model: "",  // the server's own model
    stream: true,
    stream_options: { include_usage: true },  // the usage chunk says how much prefix was reused
    max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 32),
    media: mediaOptions(),
    messages: conversationMessages(question),
  };
  if ($("pruning").value) body.pruning = { preset: $("pruning").value };
  if ($("show-probs").checked) Object.assign(body, { logprobs: true, top_logprobs: TOP_LOGPROBS });
  const answering = new AbortController();
  state.answering = answering;
  try {
    await streamAnswer(card, text, question, conversation, body, answering.signal);
  } catch (err) {
    if (!answering.signal.aborted) throw err;  // stopped by newConversation(): nothing to show
    card.remove();
  } finally {
    if (state.answering === answering) state.answering = null;
  }
}

async function streamAnswer(card, text, question, conversation, body, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: apiHeaders(), body: JSON.stringify(body), signal,
  });
  if (!response.ok) {
    text.classList.remove("streaming");
    card.remove();
    return showError(await errorMessage(response));
  }
  let epd = null, usage = null, complete = false;
  const thinking = card.querySelector(".thinking");
  try {
    complete = await readSse(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = (chunk.choices || [])[0];
      if (choice && choice.delta) showDelta(choice.delta, choice.logprobs, thinking, text);
      if (chunk.epd) epd = chunk.epd;
      if (chunk.usage) usage = chunk.usage;
    });
  } finally {
    text.classList.remove("streaming");
  }
  // A stream cut short (the connection or a proxy dropped it) has no [DONE]: say so rather than
  // show part of an answer as if it were all of it.
  if (!complete) throw new Error("the answer stream ended before the answer was complete; ask again");
  if (conversation !== state.conversation) return;
  if (epd) {
    renderBadges(card.querySelector(".badges"), epd, reusedPromptTokens(usage, epd));
    renderTimeline(card.querySelector(".timeline"), timings(epd.timings_ms || {}));
    renderFrames(epd);
    // Only a finished answer joins the conversation; a failed turn can be asked again.
    state.turns.push({ question, answer: text.textContent });
    showConversation();
  }
}

function showDelta(delta, logprobs, thinking, text) {
  // The reasoning goes to the "Thinking" block, open while it streams and closed when the answer
  // begins (a click opens it again); the content is the answer.
  const reasoning = delta.reasoning != null ? delta.reasoning : delta.reasoning_content;
  const tokens = logprobs && Array.isArray(logprobs.content) ? logprobs.content : null;
  if (reasoning) {
    if (thinking.hidden) {
      thinking.hidden = false;
      thinking.open = true;
    }
    appendPiece(thinking.querySelector(".thinking-text"), reasoning, tokens);
  }
  if (delta.content) {
    if (!thinking.hidden && !text.textContent) thinking.open = false;
    appendPiece(text, delta.content, tokens);
  }
}

function appendPiece(box, piece, tokens) {
  // A piece of streamed text; with logprobs, a span shaded by the probability of the chunk's
  // tokens together (a chunk is one decoding step: usually one token), its tooltip one line a token.
  if (!tokens || !tokens.length) {
    box.append(piece);
    return;
  }
  const logprob = tokens.reduce((sum, t) => sum + t.logprob, 0);
  const span = document.createElement("span");
  span.className = "token-prob";
  span.textContent = piece;
  span.dataset.logprob = String(logprob);
  span.style.backgroundColor = probabilityColour(Math.exp(logprob));
  span.title = tokens.map(tokenLine).join("\n");
  box.appendChild(span);
}

function tokenLine(t) {
  const top = (t.top_logprobs || []).map((a) => `${JSON.stringify(a.token)} ${percent(a.logprob)}`);
  return `${JSON.stringify(t.token)}: ${percent(t.logprob)} (logprob ${t.logprob.toFixed(3)})` +
    (top.length ? `; most likely: ${top.join(", ")}` : "");
}

function percent(logprob) {
  return (100 * Math.exp(logprob)).toFixed(1) + "%";
}

function probabilityColour(p) {
  // red (unlikely) through yellow to green (likely), light enough for the text on it to read
  return `hsl(${Math.round(120 * Math.min(1, Math.max(0, p)))}, 70%, 85%)`;
}

function reusedPromptTokens(usage, epd) {
  const details = usage && usage.prompt_tokens_details;
  if (details && details.cached_tokens) return details.cached_tokens;
  return (epd && epd.num_reused_prompt_tokens) || 0;
}

async function readSse(response, onChunk) {
  // -> true when the stream ended with its `data: [DONE]`, false when it was cut short.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return true;
        onChunk(JSON.parse(data));
      }
    }
  }
}

function badge(box, label, extraClass) {
  const span = document.createElement("span");
  span.className = "badge" + (extraClass ? " " + extraClass : "");
  span.textContent = label;
  box.appendChild(span);
}

function renderBadges(box, epd, reusedTokens) {
  box.innerHTML = "";
  if (epd.encoder_cache_hit) badge(box, "cache hit: video reused", "cache-hit");
  else badge(box, "cache miss: video encoded", "cache-miss");
  badge(box, `${epd.num_frames} frames`);
  badge(box, `${epd.num_visual_tokens} visual tokens`);
  if (epd.kv_num_bytes) badge(box, `KV ${(epd.kv_num_bytes / 1024).toFixed(1)} KiB moved`);
  if (reusedTokens > 0) badge(box, `reused prefix: ${reusedTokens} tokens`, "prefix-hit");
  const t = epd.timings_ms || {};
  if (t.ttft !== undefined) badge(box, `TTFT ${t.ttft.toFixed(0)} ms`, "timing");
  if (t.total !== undefined) badge(box, `total ${t.total.toFixed(0)} ms`, "timing");
}

function timings(t) {
  // A server before 0.2 sends video decoding only under its old name, "decode".
  const out = { ...t };
  if (out.video_decode === undefined && out.decode !== undefined) out.video_decode = out.decode;
  delete out.decode;
  return out;
}

function renderTimeline(box, t) {
  // Stages run one after another except that the KV pull happens inside generation's first step:
  // video_decode | encode | prefill | generate (kv_transfer at its start).
  const start = { video_decode: 0 };
  start.encode = t.video_decode || 0;
  start.prefill = start.encode + (t.encode || 0);
  start.kv_transfer = start.prefill + (t.prefill || 0);
  start.generate = start.kv_transfer;
  const end = Math.max(t.total || 0, ...STAGES.map((s) => start[s] + (t[s] || 0)), 1);
  box.innerHTML = "";
  for (const stage of STAGES) {
    if (t[stage] === undefined) continue;
    const row = document.createElement("div");
    row.className = "stage-row";
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = stage.replace("_", " ");
    const track = document.createElement("div");
    track.className = "track";
    const bar = document.createElement("div");
    bar.className = "stage-bar";
    bar.dataset.stage = stage;
    bar.style.left = (100 * start[stage] / end).toFixed(2) + "%";
    bar.style.width = (100 * t[stage] / end).toFixed(2) + "%";
    bar.title = `${stage}: ${t[stage].toFixed(1)} ms`;
    track.appendChild(bar);
    if (stage === "generate" && t.ttft !== undefined) {
      const marker = document.createElement("div");
      marker.className = "ttft-marker";
      marker.style.left = (100 * t.ttft / end).toFixed(2) + "%";
      marker.title = `first token at ${t.ttft.toFixed(1)} ms`;
      track.appendChild(marker);
    }
    const ms = document.createElement("span");
    ms.className = "ms";
    ms.textContent = t[stage].toFixed(1) + " ms";
    row.append(name, track, ms);
    box.appendChild(row);
  }
  const footer = document.createElement("div");
  footer.className = "timeline-footer";
  footer.textContent = `total ${(t.total || 0).toFixed(1)} ms · dashed line: first token`;
  box.appendChild(footer);
}

// ---- wiring -----------------------------------------------------------------------------------

$("file-input").addEventListener("change", (e) => {
  const file = e.target.files[0];
  if (file) useMedia(file, file.name, []).catch((err) => showError(String(err)));
});
$("use-sample").addEventListener("click", () => useSample().catch((err) => showError(String(err))));
$("num-frames").addEventListener("change", () => loadFrames().catch((err) => showError(String(err))));
$("new-conversation").addEventListener("click", () => { if (!state.busy) newConversation(); });
// The API key stays in this page's memory only: in localStorage it outlived the tab, on disk,
// readable by any script of this origin. Remove what earlier versions of the page stored.
localStorage.removeItem("epd-api-key");
$("ask-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const question = $("question").value.trim();
  if (!question || !state.dataUrl || state.busy) return;
  state.busy = true;
  $("ask").disabled = true;
  showError("");
  try {
    await loadFrames();
    await ask(question);
  } catch (err) {
    showError(String(err.message || err));
  } finally {
    state.busy = false;
    $("ask").disabled = false;
  }
});
loadSamples();
renderFrames(null);
showConversation();
