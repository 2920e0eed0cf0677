// The web page's Edit tab: instruction editing ("make the sky purple") on a model that edits from images. Loaded after
// app.js, whose helpers ($, make, api, run, state ...) it uses.
//
// An edit is A1111's /sdapi/v1/img2img with sdlite's ``sdlite_edit``: init_images are the source (image 1) and the
// further images (2, 3), all of them reference images, and the output is drawn from noise at the source's size as the
// model fits it, unless a size is given; steps and CFG scale left empty are the model's own. A model that does not
// edit from images is refused by the server; the tab says so before (sdlite_edits_from_images in /options).
"use strict";

const MAX_EDIT_IMAGES = 3;   // the source and two more (Qwen-Image-Edit Plus's three; klein takes more)
const EDITING_MODELS = "FLUX.2 [klein], FLUX.1 Kontext or Qwen-Image-Edit";

const edit = {
  source: null,   // image 1 as a data URI
  refs: [],       // images 2 and 3 as data URIs
};

// --- the images --------------------------------------------------------------------------------------------------

function showEditImages() {
  const has = Boolean(edit.source);
  $("edit-source-box").hidden = !has;
  if (has && $("edit-source-preview").src !== edit.source) {
    $("edit-source-size").textContent = "";
    $("edit-source-preview").src = edit.source;
  }
  if (!has) $("edit-source").value = "";
  $("edit-refs").replaceChildren(...edit.refs.map((src, i) => {
    const n = i + 2;
    const remove = make("button", { type: "button", textContent: "Remove" });
    remove.setAttribute("aria-label", `Remove image ${n}`);
    remove.addEventListener("click", () => {
      edit.refs.splice(i, 1);
      showEditImages();
      ($("edit-refs").querySelector("button") || $("edit-ref")).focus();   // focus stays in the list, or goes to Add
    });
    return make("li", {}, [make("img", { src, alt: `Image ${n}` }), make("span", { textContent: `image ${n}` }),
      remove]);
  }));
  const full = 1 + edit.refs.length >= MAX_EDIT_IMAGES;
  $("edit-ref").disabled = full;
  $("edit-ref-hint").textContent = full ? `${MAX_EDIT_IMAGES} images in all: remove one to add another.`
    : "Or drop them here.";
}

async function addEditFiles(files, asSource) {
  // ``files`` read as data URIs: with ``asSource`` the first is the source, any others more images (up to the limit)
  const list = [...(files || [])];
  if (!list.length) return;
  let uris;
  try {
    const bad = list.find((f) => f.type && !f.type.startsWith("image/"));
    if (bad) throw new Error(`${bad.name} is not an image (${bad.type})`);
    uris = await Promise.all(list.map(readFile));
  } catch (err) {
    showError({ title: "Cannot read the file", lines: [String(err.message || err)] });
    return;
  }
  clearError();
  if (asSource) edit.source = uris.shift();
  const room = Math.max(0, MAX_EDIT_IMAGES - 1 - edit.refs.length);
  edit.refs.push(...uris.slice(0, room));
  if (uris.length > room) {
    showError({ title: `At most ${MAX_EDIT_IMAGES} images in all`,
      lines: [`${uris.length - room} of the images were left out: remove one to add another.`] });
  }
  showEditImages();
}

function dropZone(zone, asSource) {
  const hasFiles = (e) => [...(e.dataTransfer?.types || [])].includes("Files");
  zone.addEventListener("dragover", (e) => {
    if (!hasFiles(e)) return;
    e.preventDefault();
    e.dataTransfer.dropEffect = "copy";
    zone.classList.add("dragover");
  });
  zone.addEventListener("dragleave", (e) => { if (!zone.contains(e.relatedTarget)) zone.classList.remove("dragover"); });
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    e.stopPropagation();
    zone.classList.remove("dragover");
    addEditFiles(e.dataTransfer.files, asSource);
  });
}

// --- the model ---------------------------------------------------------------------------------------------------

function showEditModel() {
  const note = $("edit-model");
  const model = state.model ? `The current model, ${state.model},` : "The current model";
  if (state.edits === false) {
    note.className = "note refused";
    note.textContent = `${model} is not an editing model: editing by instruction needs one that edits from images ` +
      `(${EDITING_MODELS}). Switch the server to one (sdlite serve --model, or sd_model_checkpoint in ` +
      `/sdapi/v1/options). To redraw an image with this model, use the Generate tab's "Image to image".`;
  } else if (state.edits) {
    note.className = "note ok";
    note.textContent = `${model} edits from images: say what to change.`;
  } else {
    note.className = "note";
    note.textContent = "The server cannot tell yet whether the current model edits from images " +
      `(${EDITING_MODELS} do); it refuses the edit if it does not.`;
  }
  $("edit-form").dataset.edits = String(state.edits);
  updateRunButtons();
}

// --- the request ---------------------------------------------------------------------------------------------------

function editRequest() {
  const body = {
    prompt: $("edit-prompt").value,
    seed: num("edit-seed"),
    batch_size: 1,
    n_iter: 1,
    init_images: [edit.source, ...edit.refs],
    sdlite_edit: true,
    send_images: true,
    save_images: false,
  };
  // left out: the model's own steps and CFG scale, the source's size as the model fits it
  for (const [id, key] of [["edit-steps", "steps"], ["edit-cfg", "cfg_scale"], ["edit-width", "width"],
    ["edit-height", "height"]]) {
    const value = optionalNum(id);
    if (value !== null) body[key] = value;
  }
  return body;
}

async function runEdit(event) {
  event?.preventDefault();
  if (state.busy) return;
  clearError();
  showWarnings([]);
  if (state.edits === false) {
    showError({ title: "Not an editing model", lines: [$("edit-model").textContent] });
    return;
  }
  if (!edit.source) {
    showError({ title: "No source image", lines: ["Choose the image to edit (or drop it on the source box)."] });
    $("edit-source").focus();
    return;
  }
  if (!$("edit-prompt").value.trim()) {
    showError({ title: "No instruction", lines: ["Say what to change, e.g. make the sky purple."] });
    $("edit-prompt").focus();
    return;
  }
  if (!checkForm($("edit-form"))) return;
  const ok = await run("img2img", editRequest(), "Editing…", { edit: { source: edit.source, refs: [...edit.refs] } });
  if (!ok) refreshModel();   // refused as no editing model: another client may have switched it
}

// --- what app.js asks of the tab -----------------------------------------------------------------------------------

const editTab = {
  fill(entry) {
    // "Reuse all parameters" of an edit: its instruction, seed, the fields it set, and its images
    const p = entry.params;
    $("edit-prompt").value = p.prompt ?? "";
    $("edit-seed").value = entry.seed ?? p.seed ?? -1;
    for (const [id, key] of [["edit-steps", "steps"], ["edit-cfg", "cfg_scale"], ["edit-width", "width"],
      ["edit-height", "height"]]) {
      $(id).value = p[key] ?? "";
    }
    edit.source = entry.edit.source;
    edit.refs = [...entry.edit.refs];
    showEditImages();
    $("edit-prompt").focus();
  },
  useAsSource(src) {
    edit.source = src;
    showEditImages();
    $("edit-source").focus();
  },
};

function initEdit() {
  RUN_BUTTONS.push({ run: "edit-run", stop: "edit-interrupt", idle: "Edit", working: "Editing…",
    usable: () => state.edits !== false });
  $("edit-form").addEventListener("submit", runEdit);
  $("edit-form").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) runEdit(e);
  });
  $("edit-random-seed").addEventListener("click", () => { $("edit-seed").value = -1; });
  $("edit-source").addEventListener("change", (e) => addEditFiles(e.target.files, true));
  $("edit-ref").addEventListener("change", async (e) => {
    await addEditFiles(e.target.files, false);
    e.target.value = "";   // the list shows them; the same file can be added again
  });
  $("edit-source-clear").addEventListener("click", () => {
    edit.source = null;
    showEditImages();
    $("edit-source").focus();
  });
  $("edit-source-preview").addEventListener("load", () => {
    const img = $("edit-source-preview");
    $("edit-source-size").textContent = `${img.naturalWidth}×${img.naturalHeight}`;
  });
  dropZone($("edit-drop"), true);
  dropZone($("edit-refs-box"), false);
  // a file dropped anywhere else would make the browser open it, leaving the page (and the session's history)
  for (const type of ["dragover", "drop"]) {
    document.addEventListener(type, (e) => {
      if ([...(e.dataTransfer?.types || [])].includes("Files")) e.preventDefault();
    });
  }
  document.addEventListener("modelchange", showEditModel);
  document.addEventListener("tabchange", (e) => { if (e.detail === "edit") refreshModel(); });
  showEditImages();
  showEditModel();
}

initEdit();
