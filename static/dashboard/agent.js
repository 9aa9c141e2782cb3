/* Agent page: show only the credential fields of the chosen kind. */
(function () {
  "use strict";
  const kind = document.getElementById("id_kind");
  if (!kind) return;
  const fieldOf = (id) => { const el = document.getElementById(id); return el ? el.closest(".field") : null; };
  function sync() {
    const token = fieldOf("id_token"), key = fieldOf("id_api_key");
    const placement = document.querySelector("#credentials-form details");
    if (token) token.hidden = kind.value !== "bearer";
    if (key) key.hidden = kind.value !== "api-key";
    if (placement) placement.hidden = kind.value !== "api-key";
  }
  kind.addEventListener("change", sync);
  sync();
})();
