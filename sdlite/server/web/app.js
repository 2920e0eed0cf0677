// sdlite's web page: a small client of the AUTOMATIC1111-style API under /sdapi/v1. No build step. The Generate tab,
// the output, progress and history are here; the Edit tab is edit.js (loaded after this file).
"use strict";

const API = "/sdapi/v1";
const $ = (id) => document.getElementById(id);

const state = {
  busy: false,
  interrupted: false,
  run: 0,            // increases with every generation; a stale poll loop stops when it sees a newer one
  started: 0,
  init: null,        // source image as a data URI
  mask: null,        // mask as a data URI
  control: null,     // ControlNet control image as a data URI
  history: [],       // {src, infotext, seed, params, endpoint, edit?: {source, refs}}
  selected: null,
  tab: "generate",   // the tab shown: "generate" or "edit"
  model: "",         // the current model's title
  edits: null,       // whether it edits from images (the Edit tab's models); null: the server cannot tell
};

// the buttons that start a run, each with its Interrupt button: edit.js adds the Edit tab's. ``usable``: whether the
// button may be pressed when no run is going
const RUN_BUTTONS = [
  { run: "generate", stop: "interrupt", idle: "Generate", working: "Generating…", usable: () => true },
];

function make(tag, props = {}, children = []) {
  const node = Object.assign(document.createElement(tag), props);
  for (const c of children) node.append(c);
  return node;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// --- talking to the server ---------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, title, lines) {
    super(lines.join("\n") || title);
    this.status = status;
    this.title = title;
    this.lines = lines;
  }
}

function describe(status, statusText, body, text) {
  // Turn any error answer into a title and readable lines: {error, detail, errors}, FastAPI's 422 lists, text.
  let title = `Error ${status}${statusText ? " " + statusText : ""}`;
  let lines = [];
  if (body && typeof body === "object" && body.error) title = `${body.error} (${status})`;
  if (status === 503) title = "The server is busy (503): its queue is full, try again in a moment";
  if (body && typeof body === "object") {
    const d = body.detail ?? body.message ?? body.errors;
    if (Array.isArray(d)) {
      lines = d.map((x) => {
        if (typeof x !== "object" || x === null) return String(x);
        const where = (x.loc || []).filter((p) => p !== "body").join(".");
        return (where ? where + ": " : "") + (x.msg ?? JSON.stringify(x));
      });
    } else if (d && typeof d === "object") {
      lines = [JSON.stringify(d)];
    } else if (d !== undefined && d !== null && d !== "") {
      lines = [String(d)];
    }
    if (body.errors && body.errors !== d) lines.push(String(body.errors));
  } else if (text) {
    lines = [text.trim().slice(0, 500)];
  }
  return new ApiError(status, title, lines);
}

async function api(path, options = {}, base = API) {
  let res;
  try {
    res = await fetch(base + path, {
      ...options,
      headers: options.body ? { "Content-Type": "application/json" } : {},
    });
  } catch (e) {
    throw new ApiError(0, "Cannot reach the server", [String(e.message || e)]);
  }
  const text = await res.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch { /* not JSON */ }
  if (!res.ok) throw describe(res.status, res.statusText, body, text);
  return body;
}

// --- messages ----------------------------------------------------------------------------------------------

function showError(err) {
  const box = $("error");
  box.replaceChildren(make("strong", { textContent: err.title || "Error" }));
  for (const line of err.lines || [String(err.message || err)]) box.append(make("div", { textContent: line }));
  box.hidden = false;
  box.scrollIntoView({ block: "nearest" });
}

function clearError() {
  $("error").hidden = true;
  $("error").replaceChildren();
}

function showWarnings(warnings) {
  const list = Array.isArray(warnings) ? warnings : [];
  $("warnings").replaceChildren(...list.map((w) => make("div", { textContent: "⚠ " + w })));
  $("warnings").hidden = !list.length;
}

const status = (text) => { $("status").textContent = text; };

// --- form <-> request --------------------------------------------------------------------------------------

const num = (id) => Number($(id).value);
const optionalNum = (id) => ($(id).value.trim() === "" ? null : Number($(id).value));

function labelOf(input) {
  const label = document.querySelector(`label[for="${input.id}"]`);
  return label ? label.childNodes[0].textContent.trim() : input.id;
}

function checkForm(form = $("form")) {
  // The browser's own checks (ranges, multiples of 8), reported as one readable message.
  const bad = [...form.querySelectorAll("input, select, textarea")].filter((i) => !i.checkValidity());
  if (!bad.length) return true;
  showError({ title: "Please correct the form", lines: bad.map((i) => `${labelOf(i)}: ${i.validationMessage}`) });
  bad[0].focus();
  return false;
}

function buildRequest() {
  const body = {
    prompt: $("prompt").value,
    negative_prompt: $("negative").value,
    steps: num("steps"),
    cfg_scale: num("cfg"),
    seed: num("seed"),
    batch_size: num("batch"),
    n_iter: 1,
    send_images: true,
    save_images: false,
  };
  const width = optionalNum("width"), height = optionalNum("height");
  if (width !== null) body.width = width;      // left out: the model's native size
  if (height !== null) body.height = height;
  if ($("sampler").value) body.sampler_name = $("sampler").value;   // none listed: the server's default
  if ($("scheduler").value) body.scheduler = $("scheduler").value;
  if ($("refiner").value) {   // SDXL's base-to-refiner hand-off (the server refuses it for img2img, and says so)
    body.refiner_checkpoint = $("refiner").value;
    body.refiner_switch_at = num("refiner-switch");
  }
  if ($("hires").checked && !state.init) {   // A1111's hires fix: txt2img only
    body.enable_hr = true;
    body.hr_upscaler = $("hr-upscaler").value;
    body.hr_scale = num("hr-scale");
    body.hr_second_pass_steps = num("hr-steps");
    body.denoising_strength = num("hr-denoise");
  }
  const unit = controlUnit();
  if (unit) body.alwayson_scripts = { controlnet: { args: [unit] } };
  let endpoint = "txt2img";
  if (state.init) {
    endpoint = "img2img";
    body.init_images = [state.init];
    body.denoising_strength = num("denoising");
    if (state.mask) {
      body.mask = state.mask;
      body.mask_blur = num("mask-blur");
      body.inpainting_fill = num("inpainting-fill");
      body.inpainting_mask_invert = $("mask-invert").checked ? 1 : 0;
    }
  }
  return { endpoint, body };
}

function controlUnit() {
  // A1111's ControlNet extension's unit (alwayson_scripts.controlnet.args[0]); none unless enabled with a model
  if (!$("cn-enabled").checked || !$("cn-model").value) return null;
  return {
    enabled: true,
    module: $("cn-module").value,
    model: $("cn-model").value,
    weight: num("cn-weight"),
    image: state.control || "",      // "": the source image (image to image)
    resize_mode: "Crop and Resize",
    guidance_start: num("cn-start"),
    guidance_end: num("cn-end"),
    control_mode: "Balanced",
    pixel_perfect: false,
  };
}

function fillControl(params) {
  const unit = params.alwayson_scripts?.controlnet?.args?.[0];
  $("cn-enabled").checked = Boolean(unit);
  if (!unit) return;
  if ([...$("cn-model").options].some((o) => o.value === unit.model)) $("cn-model").value = unit.model;
  if ([...$("cn-module").options].some((o) => o.value === unit.module)) $("cn-module").value = unit.module;
  $("cn-weight").value = unit.weight;
  $("cn-start").value = unit.guidance_start;
  $("cn-end").value = unit.guidance_end;
}

function fillForm(params) {
  const set = (id, v) => { if (v !== undefined && v !== null) $(id).value = v; };
  set("prompt", params.prompt);
  set("negative", params.negative_prompt);
  set("steps", params.steps);
  set("cfg", params.cfg_scale);
  set("seed", params.seed);
  set("batch", params.batch_size);
  $("width").value = params.width ?? "";
  $("height").value = params.height ?? "";
  if (params.sampler_name && [...$("sampler").options].some((o) => o.value === params.sampler_name)) {
    $("sampler").value = params.sampler_name;
  }
  $("hires").checked = Boolean(params.enable_hr);
  if (params.enable_hr) {
    if ([...$("hr-upscaler").options].some((o) => o.value === params.hr_upscaler)) {
      $("hr-upscaler").value = params.hr_upscaler;
    }
    set("hr-scale", params.hr_scale);
    set("hr-steps", params.hr_second_pass_steps);
    set("hr-denoise", params.denoising_strength);
  }
  const refiner = params.refiner_checkpoint ?? "";
  if ([...$("refiner").options].some((o) => o.value === refiner)) $("refiner").value = refiner;
  set("refiner-switch", params.refiner_switch_at);
  fillControl(params);
}

// --- progress ----------------------------------------------------------------------------------------------

function setProgress(fraction) {
  const p = Math.max(0, Math.min(1, fraction));
  $("progress").value = p;
  $("progress").setAttribute("aria-valuenow", String(Math.round(p * 100)));
}

function formatSeconds(s) {
  if (!Number.isFinite(s) || s < 0) return "";
  return s < 60 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

function showProgress(p) {
  if (!p) return;
  const st = p.state || {};
  const steps = st.sampling_steps || 0;
  if (typeof p.progress === "number") setProgress(p.progress);
  const parts = [];
  if (st.job_count > 1) parts.push(`Image ${Math.min((st.job_no || 0) + 1, st.job_count)}/${st.job_count}`);
  if (steps) parts.push(`Step ${st.sampling_step || 0}/${steps}`);
  if (p.progress > 0 && p.eta_relative > 0) parts.push(`ETA ${formatSeconds(p.eta_relative)}`);
  if (parts.length) $("eta").textContent = parts.join(" · ");
  if (p.textinfo && !state.interrupted) status(p.textinfo);
  if (p.current_image) {
    const src = dataUri(p.current_image);
    if ($("preview").src !== src) $("preview").src = src;
    $("preview").hidden = false;
  }
}

async function poll(run) {
  while (state.busy && state.run === run) {
    try {
      const p = await api("/progress?skip_current_image=false");
      if (state.busy && state.run === run) showProgress(p);
    } catch { /* a missed poll is not an error; the generation request reports failures */ }
    await sleep(200);
  }
}

// --- results and history -----------------------------------------------------------------------------------

const dataUri = (b64) => (b64.startsWith("data:") ? b64 : "data:image/png;base64," + b64);

function parseInfo(info) {
  if (!info) return {};
  if (typeof info === "object") return info;
  try { return JSON.parse(info); } catch { return { infotexts: [String(info)] }; }
}

function entriesFrom(data, endpoint, request) {
  const images = data.images || [];
  const info = parseInfo(data.info);
  const first = Number.isInteger(info.index_of_first_image) ? info.index_of_first_image : 0;
  const texts = info.infotexts || [];
  const seeds = info.all_seeds || [];
  const entries = [];
  // after the generated images the server may send ControlNet's control maps (one infotext per generated image)
  const generated = texts.length && first + texts.length < images.length ? first + texts.length : images.length;
  for (let i = first; i < generated; i++) {
    const k = i - first;
    const seed = seeds[k] ?? (typeof info.seed === "number" ? info.seed + k : undefined);
    const infotext = texts.length === images.length ? texts[i] : (texts[k] ?? "");
    entries.push({
      src: dataUri(images[i]),
      infotext: infotext || JSON.stringify(info, null, 1),
      seed,
      endpoint,
      params: { ...request, seed, batch_size: 1, init_images: undefined, mask: undefined },
    });
  }
  return entries;
}

function mapsFrom(data) {
  // the control maps after the generated images, as data URIs
  const images = data.images || [];
  const info = parseInfo(data.info);
  const first = Number.isInteger(info.index_of_first_image) ? info.index_of_first_image : 0;
  const texts = info.infotexts || [];
  return texts.length && first + texts.length < images.length
    ? images.slice(first + texts.length).map(dataUri) : [];
}

function select(entry) {
  state.selected = entry;
  $("info").textContent = entry.infotext + (entry.seed !== undefined && !/Seed:/.test(entry.infotext)
    ? `\nSeed: ${entry.seed}` : "");
  $("details").hidden = false;
  $("upscale-selected").disabled = state.busy;
  for (const b of document.querySelectorAll("#results button, #history button")) {
    b.setAttribute("aria-pressed", String(b.entry === entry));
  }
}

function imageButton(entry, label) {
  const img = make("img", { src: entry.src, alt: label });
  const button = make("button", { type: "button", className: "thumb", title: label }, [img]);
  button.entry = entry;
  button.addEventListener("click", () => select(entry));
  return button;
}

function showResults(entries, maps = []) {
  const figures = entries.map((e) => make("figure", {}, [
    imageButton(e, `Result, seed ${e.seed ?? "?"}`),
    make("figcaption", { textContent: e.seed !== undefined ? `seed ${e.seed}` : "" }),
  ]));
  const mapFigures = maps.map((src, i) => make("figure", { className: "control-map" }, [
    make("img", { src, alt: `ControlNet control map ${i + 1}` }),
    make("figcaption", { textContent: "control map" }),
  ]));
  $("results").replaceChildren(...figures, ...mapFigures);
  for (const e of entries) {
    state.history.unshift(e);
    const n = state.history.length;
    const label = `Image ${n}, seed ${e.seed ?? "?"}: ${e.edit ? "edit: " : ""}${e.params.prompt || "(no prompt)"}`;
    $("history").prepend(make("li", {}, [imageButton(e, label)]));
  }
  if (entries.length) select(entries[0]);
}

// --- upscale (A1111's extras) ------------------------------------------------------------------------------

async function upscaleSelected() {
  const entry = state.selected;
  if (!entry || state.busy) return;
  clearError();
  setBusy(true);
  $("status").textContent = "Upscaling…";
  try {
    const body = { image: entry.src, upscaler_1: $("extras-upscaler").value, upscaling_resize: num("extras-scale") };
    const data = await api("/extra-single-image", { method: "POST", body: JSON.stringify(body) });
    const text = (data.html_info || "").replace(/<[^>]*>/g, " ").trim();
    const result = { ...entry, src: dataUri(data.image), infotext: entry.infotext + "\n" + text };
    showResults([result]);
    $("status").textContent = "Upscaled: " + text;
  } catch (err) {
    showError(err);
    $("status").textContent = "";
  } finally {
    setBusy(false);
  }
}

// --- generate / interrupt ----------------------------------------------------------------------------------

function setBusy(busy) {
  // keyboard focus follows: Generate (Edit) -> Interrupt while running, and back (a disabled button loses focus)
  const focused = document.activeElement;
  state.busy = busy;
  updateRunButtons();
  for (const b of RUN_BUTTONS) {
    $(b.run).textContent = busy ? b.working : b.idle;
    const [from, to] = busy ? [b.run, b.stop] : [b.stop, b.run];
    if (focused === $(from) && !$(to).disabled) $(to).focus();
  }
  $("upscale-selected").disabled = busy || !state.selected;
  document.body.classList.toggle("busy", busy);
}

function updateRunButtons() {
  for (const b of RUN_BUTTONS) {
    $(b.run).disabled = state.busy || !b.usable();
    $(b.stop).disabled = !state.busy;
  }
}

async function generate(event) {
  event?.preventDefault();
  if (state.busy) return;
  clearError();
  showWarnings([]);
  if (!checkForm()) return;
  const { endpoint, body } = buildRequest();
  await run(endpoint, body, endpoint === "img2img" ? "Image to image…" : "Generating…");
}

async function run(endpoint, body, label, extra = {}) {
  // one request to /sdapi/v1/<endpoint> with progress, its images into the results and history (each with
  // ``extra``'s fields: the Edit tab's images); false when it failed
  const id = ++state.run;
  state.interrupted = false;
  state.started = performance.now();
  setBusy(true);
  setProgress(0);
  $("eta").textContent = "";
  $("preview").hidden = true;
  status(label);
  $("progress").scrollIntoView({ block: "nearest" });   // on a narrow window the output is below the form
  poll(id);
  try {
    const data = await api("/" + endpoint, { method: "POST", body: JSON.stringify(body) });
    const entries = entriesFrom(data || {}, endpoint, body).map((e) => Object.assign(e, extra));
    const took = formatSeconds((performance.now() - state.started) / 1000);
    if (state.interrupted) {
      status(entries.length ? `Interrupted after ${took}: the image so far is shown.` : `Interrupted after ${took}.`);
    } else {
      setProgress(1);
      status(`Done in ${took}.`);
    }
    $("eta").textContent = "";
    showResults(entries, mapsFrom(data || {}));
    showWarnings(parseInfo(data?.info).warnings);
    return true;
  } catch (err) {
    setProgress(0);
    $("eta").textContent = "";
    status(state.interrupted ? "Interrupted." : "Failed.");
    showError(err);
    return false;
  } finally {
    setBusy(false);
    $("preview").hidden = true;
  }
}

async function interrupt() {
  if (!state.busy) return;
  state.interrupted = true;
  status("Interrupting…");
  try {
    await api("/interrupt", { method: "POST" });
  } catch (err) {
    showError(err);
  }
}

// --- source image and mask ---------------------------------------------------------------------------------

function readFile(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function showControl() {
  $("cn-preview").hidden = !state.control;
  if (state.control) $("cn-preview").src = state.control;
  $("cn-clear").hidden = !state.control;
}

function showSources() {
  for (const [key, id] of [["init", "init-preview"], ["mask", "mask-preview"]]) {
    $(id).hidden = !state[key];
    if (state[key]) $(id).src = state[key];
  }
  $("clear-sources").hidden = !state.init && !state.mask;
  $("generate").title = state.init ? "Image to image" + (state.mask ? " (inpainting)" : "") : "Text to image";
}

async function onFile(event, key, show = showSources) {
  const file = event.target.files[0];
  if (!file) { state[key] = null; show(); return; }
  try {
    state[key] = await readFile(file);
    clearError();
  } catch (err) {
    state[key] = null;
    showError({ title: "Cannot read the file", lines: [String(err)] });
  }
  show();
}

// --- start -------------------------------------------------------------------------------------------------

async function loadServerInfo() {
  try {
    const samplers = await api("/samplers");
    const names = samplers.map((s) => s.name);
    $("sampler").replaceChildren(...names.map((n) => make("option", { value: n, textContent: n })));
    const preferred = ["DPM++ 2M Karras", "DPM++ 2M", "Euler a"].find((n) => names.includes(n));
    if (preferred) $("sampler").value = preferred;
  } catch (err) {
    showError({ title: "Could not load the samplers", lines: err.lines || [String(err)] });
  }
  try {
    const schedulers = await api("/schedulers");
    if (Array.isArray(schedulers) && schedulers.length) {
      for (const s of schedulers.filter((x) => x.name !== "automatic")) {
        $("scheduler").append(make("option", { value: s.name, textContent: s.label || s.name }));
      }
      $("scheduler-field").hidden = false;
    }
  } catch { /* optional endpoint */ }
  try {
    const models = await api("/sd-models");
    $("refiner").append(...models.map((m) => make("option", { value: m.model_name, textContent: m.title })));
  } catch { /* without the list, no refiner is offered */ }
  try {   // the hires fix's upscalers: the latent modes, then the image upscalers
    const modes = await api("/latent-upscale-modes");
    const upscalers = await api("/upscalers");
    const latent = modes.map((m) => m.name);
    const images = upscalers.map((u) => u.name);
    $("hr-upscaler").replaceChildren(...[...latent, ...images].map((n) => make("option", { value: n, textContent: n })));
    $("extras-upscaler").replaceChildren(...images.filter((n) => n !== "None")
      .map((n) => make("option", { value: n, textContent: n })));
  } catch { /* without the lists: Latent, and Lanczos for the upscale */ }
  try {   // ControlNet (A1111's extension's routes, at the server's root): its models and preprocessors
    const models = (await api("/model_list", {}, "/controlnet")).model_list || [];
    const none = models.length ? "None" : "None (the server has no ControlNet models: --controlnet-dir)";
    $("cn-model").replaceChildren(make("option", { value: "", textContent: none }),
      ...models.map((m) => make("option", { value: m, textContent: m })));
    if (models.length) $("cn-model").value = models[0];
    const modules = await api("/module_list", {}, "/controlnet");
    const usable = modules.module_list.filter((m) => modules.module_detail?.[m]?.model_free !== false);
    $("cn-module").replaceChildren(...usable.map((m) => make("option", { value: m, textContent: m })));
  } catch { /* without the lists the panel offers no model */ }
  await refreshModel();
  document.body.dataset.serverInfo = "loaded";   // every list asked for has come back (or failed)
}

async function refreshModel() {
  // the current model's name and whether it edits from images (sdlite_edits_from_images: true, false, or null when
  // the server cannot tell), read again when the Edit tab is shown: another client may have switched the model
  try {
    const options = (await api("/options")) || {};
    state.model = options.sd_model_checkpoint || "";
    state.edits = options.sdlite_edits_from_images ?? null;
    if (state.model) $("model").textContent = "Model: " + state.model;
  } catch { /* the model name is only shown when known */ }
  document.dispatchEvent(new CustomEvent("modelchange"));
}

// --- tabs (WAI-ARIA's tabs pattern: arrow keys, Home and End move between them) -------------------------------

const TABS = { generate: ["tab-generate", "form"], edit: ["tab-edit", "edit-form"] };

function selectTab(name, focus = false) {
  state.tab = name;
  for (const [key, [tab, panel]] of Object.entries(TABS)) {
    $(tab).setAttribute("aria-selected", String(key === name));
    $(tab).tabIndex = key === name ? 0 : -1;
    $(panel).hidden = key !== name;
  }
  if (focus) $(TABS[name][0]).focus();
  document.dispatchEvent(new CustomEvent("tabchange", { detail: name }));
}

function onTabKey(event) {
  const names = Object.keys(TABS);
  const i = names.indexOf(state.tab);
  const to = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: names.length - 1 }[event.key];
  if (to === undefined) return;
  event.preventDefault();
  selectTab(names[(to + names.length) % names.length], true);
}

function init() {
  for (const [name, [tab]] of Object.entries(TABS)) $(tab).addEventListener("click", () => selectTab(name));
  $("tabs").addEventListener("keydown", onTabKey);
  $("form").addEventListener("submit", generate);
  $("interrupt").addEventListener("click", interrupt);
  $("edit-interrupt").addEventListener("click", interrupt);
  $("upscale-selected").addEventListener("click", upscaleSelected);
  $("random-seed").addEventListener("click", () => { $("seed").value = -1; });
  $("form").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate(e);
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.busy) interrupt(); });
  $("denoising").addEventListener("input", () => { $("denoising-value").value = num("denoising").toFixed(2); });
  $("init-image").addEventListener("change", (e) => onFile(e, "init"));
  $("mask").addEventListener("change", (e) => onFile(e, "mask"));
  $("cn-image").addEventListener("change", (e) => {
    $("cn-enabled").checked = true;
    onFile(e, "control", showControl);
  });
  $("cn-clear").addEventListener("click", () => {
    state.control = null;
    $("cn-image").value = "";
    showControl();
  });
  $("clear-sources").addEventListener("click", () => {
    state.init = state.mask = null;
    $("init-image").value = "";
    $("mask").value = "";
    showSources();
  });
  $("reuse-seed").addEventListener("click", () => {   // into the tab shown
    const seed = state.tab === "edit" ? $("edit-seed") : $("seed");
    if (state.selected?.seed !== undefined) seed.value = state.selected.seed;
    seed.focus();
  });
  $("reuse-all").addEventListener("click", () => {   // an edit's into the Edit tab, with its images
    if (state.selected?.edit) {
      selectTab("edit");
      editTab.fill(state.selected);
      return;
    }
    selectTab("generate");
    if (state.selected) fillForm(state.selected.params);
    $("prompt").focus();
  });
  $("use-as-source").addEventListener("click", () => {   // the source of the tab shown
    if (!state.selected) return;
    if (state.tab === "edit") {
      editTab.useAsSource(state.selected.src);
      return;
    }
    state.init = state.selected.src;
    $("init-image").value = "";
    $("img2img").open = true;
    showSources();
    $("init-image").focus();
  });
  loadServerInfo();
}

init();
