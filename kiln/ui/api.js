// What the chat page and the dashboard share: the API key (asked for once, kept in this
// browser's localStorage, sent as `Authorization: Bearer`), JSON calls that turn the server's
// OpenAI-style errors into messages, the key dialog, and copying text.
"use strict";

const KilnAPI = (() => {
  const KEY_ITEM = "kiln.apiKey";

  function apiKey() {
    return localStorage.getItem(KEY_ITEM) || "";
  }

  function setApiKey(key) {
    if (key) localStorage.setItem(KEY_ITEM, key);
    else localStorage.removeItem(KEY_ITEM);
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  // An Error whose message is the server's `error.message` when it sent one.
  async function errorOf(response) {
    let message = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) {
      // not JSON: keep the status line
    }
    const err = new Error(message);
    err.status = response.status;
    return err;
  }

  // GET a JSON path; on 401 ask for the key (unless the dialog was dismissed: the dashboard
  // polls every second) and try again.
  async function getJSON(path) {
    for (let attempt = 0; ; attempt++) {
      const r = await fetch(path, { headers: headers() });
      if (r.status === 401 && attempt === 0 && !declined && (await askKey(true))) continue;
      if (!r.ok) throw await errorOf(r);
      return r.json();
    }
  }

  // The key dialog, built here the first time it is needed so both pages share one markup.
  // Resolves true when a key was saved. `rejected`: the server refused the key there is (or
  // that there is none).
  let pending = null;
  let declined = false;
  function keyDialog() {
    let dialog = document.getElementById("key-dialog");
    if (dialog) return dialog;
    dialog = document.createElement("dialog");
    dialog.id = "key-dialog";
    dialog.innerHTML =
      '<form method="dialog"><h3>API key</h3><p class="key-note"></p>' +
      '<input type="password" autocomplete="off" placeholder="sk-...">' +
      '<div class="row end"><button type="button" class="key-cancel">Cancel</button>' +
      '<button type="submit">Save</button></div></form>';
    document.body.appendChild(dialog);
    return dialog;
  }
  function askKey(rejected) {
    if (pending) return pending;
    const dialog = keyDialog();
    const input = dialog.querySelector("input");
    const note = dialog.querySelector(".key-note");
    input.value = apiKey();
    note.textContent = rejected
      ? "The server wants an API key (kiln serve --api-key): the one it has is missing or wrong."
      : "The key is kept in this browser (localStorage) and sent with every API request.";
    pending = new Promise((resolve) => {
      const done = (ok) => {
        dialog.querySelector("form").onsubmit = null;
        dialog.querySelector(".key-cancel").onclick = null;
        dialog.close();
        pending = null;
        declined = !ok;
        resolve(ok);
      };
      dialog.querySelector("form").onsubmit = (e) => {
        e.preventDefault();
        setApiKey(input.value.trim());
        done(true);
      };
      dialog.querySelector(".key-cancel").onclick = () => done(false);
      dialog.showModal();
      input.focus();
    });
    return pending;
  }

  // navigator.clipboard exists only in secure contexts (https, localhost); elsewhere the old
  // textarea + execCommand way still works.
  async function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      try {
        await navigator.clipboard.writeText(text);
        return true;
      } catch (_) {
        // fall through to the old way
      }
    }
    const ta = document.createElement("textarea");
    ta.value = text;
    ta.setAttribute("readonly", "");
    ta.className = "offscreen";
    document.body.appendChild(ta);
    ta.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch (_) {
      ok = false;
    }
    ta.remove();
    return ok;
  }

  // A copy button's short feedback.
  async function copyFrom(button, text) {
    const ok = await copyText(text);
    const label = button.textContent;
    button.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => { button.textContent = label; }, 1200);
  }

  return { apiKey, setApiKey, headers, errorOf, getJSON, askKey, copyText, copyFrom };
})();
